"""The approximate prefix index: matching, the global bound, per-server budgets, LRU leaf
eviction, server removal, and the invariants under random operations."""

from __future__ import annotations

import random

import pytest

from gateway.prefix.tree import CHARS_PER_TOKEN, PrefixTree


def check_invariants(tree: PrefixTree) -> None:
    """Accounting equals a recount; children hold subsets of their parent's servers; in the
    global order and in each worker's own order, nodes are older than their ancestors; a node
    missing from a holder's order (made by a split) has exactly one child that holder holds."""
    order = {node: i for i, node in enumerate(tree._lru)}
    own = {url: {node: i for i, node in enumerate(lru)} for url, lru in tree._lrus.items()}
    size, per_worker, stack = 0, {}, [tree._root]
    while stack:
        node = stack.pop()
        for first, child in node.children.items():
            assert child.parent is node and child.label[0] == first
            assert child.servers, "a node nobody holds must go"
            unit = 1 if isinstance(child.label, str) else CHARS_PER_TOKEN
            assert child.size == len(child.label) * unit
            if node is not tree._root:
                assert child.servers.keys() <= node.servers.keys()
                assert order[child] < order[node]
            assert child.last >= max(child.servers.values())
            size += child.size * len(child.servers)
            for url in child.servers:
                per_worker[url] = per_worker.get(url, 0) + child.size
                if child in own[url]:
                    parent = node
                    while parent is not tree._root:
                        if parent in own[url]:
                            assert own[url][child] < own[url][parent]
                        parent = parent.parent
                else:
                    assert sum(url in c.servers for c in child.children.values()) == 1
            stack.append(child)
    assert size == tree.size <= tree.max_size
    assert per_worker == tree.server_sizes()
    assert len(order) == tree.node_count
    assert set(own) == set(per_worker)
    for url, nodes in own.items():
        times = [node.servers[url] for node in nodes]
        assert times == sorted(times)


@pytest.mark.parametrize(
    ("inserts", "query", "expected"),
    [
        pytest.param([("hello world", "a")], "hello world", {"a": 11}, id="exact"),
        pytest.param([("hello world", "a")], "hello there", {"a": 6}, id="diverges_inside_edge"),
        pytest.param([("hello world", "a")], "hello", {"a": 5}, id="query_ends_inside_edge"),
        pytest.param([("hello world", "a")], "goodbye", {}, id="no_common_first_char"),
        pytest.param([("hello world", "a"), ("hello there", "b")], "hello world!",
                     {"a": 11, "b": 6}, id="each_worker_its_own_depth"),
        pytest.param([("abc", "a"), ("abcdef", "b")], "abcdxx", {"a": 3, "b": 4},
                     id="key_extends_a_leaf"),
        pytest.param([((1, 2, 3, 4), "a"), ((1, 2, 5), "b")], (1, 2, 3, 9),
                     {"a": 3, "b": 2}, id="token_ids"),
        pytest.param([((1, 2, 3), "a")], "abc", {}, id="tokens_and_text_never_mix"),
        pytest.param([((70000, 2**33), "a")], (70000, 2**33, 5), {"a": 2}, id="ids_beyond_uint32"),
    ],
)
def test_match(inserts, query, expected) -> None:
    tree = PrefixTree(10_000)
    for key, url in inserts:
        tree.insert(key, url)
    assert tree.match(query) == expected
    check_invariants(tree)


def test_same_key_to_two_workers_counts_twice() -> None:
    tree = PrefixTree(100)
    tree.insert("x" * 10, "a")
    tree.insert("x" * 10, "b")
    assert tree.size == 20 and tree.server_sizes() == {"a": 10, "b": 10}


def test_a_token_counts_as_four_characters() -> None:
    tree = PrefixTree(1_000)
    tree.insert(tuple(range(10)), "a")
    tree.insert("x" * 10, "a")
    assert tree.server_sizes() == {"a": 10 * CHARS_PER_TOKEN + 10}


@pytest.mark.parametrize("kind", ["text", "tokens"])
def test_bound_is_never_exceeded(kind: str) -> None:
    rng = random.Random(1)
    tree = PrefixTree(2_000)
    prefixes = ["".join(rng.choice("abcd") for _ in range(rng.randint(1, 40))) for _ in range(30)]
    for i in range(600):
        text = rng.choice(prefixes) + "".join(rng.choice("abcdef") for _ in range(rng.randint(0, 80)))
        key = text if kind == "text" else tuple(ord(c) for c in text)
        tree.insert(key, f"w{rng.randrange(4)}", now=float(i))
        assert tree.size <= 2_000
        if i % 50 == 0:
            check_invariants(tree)
    check_invariants(tree)


def test_least_recently_used_goes_first() -> None:
    tree = PrefixTree(30)
    tree.insert("a" * 10, "w", now=1)
    tree.insert("b" * 10, "w", now=2)
    tree.insert("c" * 10, "w", now=3)
    tree.insert("a" * 10, "w", now=4)  # touch: "b" is now the oldest
    tree.insert("d" * 10, "w", now=5)
    assert tree.match("b" * 10) == {}
    assert all(tree.match(k * 10) == {"w": 10} for k in "acd")
    tree.insert("e" * 10, "w", now=6)
    assert tree.match("c" * 10) == {}
    check_invariants(tree)


def test_leaves_go_before_their_shared_prefix() -> None:
    tree = PrefixTree(26)
    tree.insert("S" * 10 + "x" * 6, "w", now=1)
    tree.insert("S" * 10 + "y" * 6, "w", now=2)  # 10 + 6 + 6 = 22
    tree.insert("z" * 4, "w", now=3)  # 26
    tree.insert("S" * 10 + "q" * 2, "w", now=4)  # 28: the x leaf goes, not the shared prefix
    assert tree.match("S" * 10 + "x" * 6) == {"w": 10}
    assert tree.match("S" * 10 + "y" * 6) == {"w": 16}
    check_invariants(tree)


def test_key_longer_than_the_bound_keeps_its_head() -> None:
    tree = PrefixTree(8)
    tree.insert("0123456789abc", "w")
    assert tree.match("0123456789abc") == {"w": 8} and tree.size == 8


def test_ttl_evicts_idle_prefixes() -> None:
    tree = PrefixTree(1_000, ttl=10.0)
    tree.insert("old prompt", "w", now=0.0)
    tree.insert("new prompt", "w", now=5.0)
    tree.insert("newer", "w", now=12.0)
    assert tree.match("old prompt") == {}
    assert tree.match("new prompt") == {"w": 10}


def test_remove_worker() -> None:
    tree = PrefixTree(1_000)
    tree.insert("shared prefix then a", "a")
    tree.insert("shared prefix then b", "b")
    tree.insert("only a", "a")
    tree.remove_server("a")
    assert tree.match("shared prefix then a") == {"b": 19}
    assert tree.match("only a") == {}
    assert tree.server_sizes() == {"b": 20}
    check_invariants(tree)
    tree.remove_server("missing")  # no-op
    tree.remove_server("b")
    assert tree.size == 0 and tree.node_count == 0


def test_budget_evicts_that_workers_least_recently_used_content_only() -> None:
    tree = PrefixTree(10_000)
    tree.insert("a" * 10, "w", now=1, budget=30)
    tree.insert("b" * 10, "w", now=2, budget=30)
    tree.insert("b" * 10, "v", now=3, budget=30)
    tree.insert("c" * 10, "w", now=4, budget=30)
    tree.insert("d" * 10, "w", now=5, budget=30)  # 40 > 30: w's oldest ("a") goes
    assert tree.match("a" * 10) == {}
    assert tree.server_sizes() == {"w": 30, "v": 10}
    tree.insert("e" * 10, "w", now=6, budget=30)  # then "b", which v still holds
    assert tree.match("b" * 10) == {"v": 10}
    assert tree.oldest("w") == 4 and tree.oldest("v") == 3 and tree.oldest("x") is None
    check_invariants(tree)


def test_budget_takes_a_workers_leaves_before_its_shared_prefix() -> None:
    tree = PrefixTree(10_000)
    system = "S" * 20
    tree.insert(system + "x" * 10, "w", now=1, budget=45)
    tree.insert(system + "y" * 10, "w", now=2, budget=45)
    tree.insert(system + "z" * 10, "v", now=3, budget=45)
    tree.insert(system + "q" * 10, "w", now=4, budget=45)  # 50 > 45: the x branch goes
    assert tree.match(system + "x" * 10) == {"w": 20, "v": 20}
    assert tree.match(system + "y" * 10) == {"w": 30, "v": 20}
    check_invariants(tree)


def test_a_node_cut_by_another_worker_leaves_with_the_part_below_it() -> None:
    """v's key splits w's leaf; the upper part is not in w's order, and goes for w right after
    w's lower part does (while v keeps it)."""
    tree = PrefixTree(10_000)
    tree.insert("abcdef", "w", now=1, budget=12)
    tree.insert("abcxyz", "v", now=2)
    check_invariants(tree)
    tree.insert("qrstuvwx", "w", now=3, budget=12)  # 14 > 12: all of "abcdef" goes for w
    assert tree.match("abcdef") == {"v": 3}
    assert tree.server_sizes() == {"w": 8, "v": 6}
    check_invariants(tree)


def test_key_longer_than_the_budget_keeps_its_head() -> None:
    tree = PrefixTree(10_000)
    tree.insert(tuple(range(100)), "w", budget=10 * CHARS_PER_TOKEN)
    assert tree.match(tuple(range(100))) == {"w": 10}


@pytest.mark.parametrize(
    ("inserts", "query", "end", "used"),
    [
        pytest.param(["turn one"], "turn one, turn two", 8, {"a": 1.0}, id="continues_a_key"),
        pytest.param(["shared x", "shared y"], "shared z", 0, {}, id="branch_off_a_split"),
        pytest.param(["shared x"], "shared", 0, {}, id="ends_inside_an_edge"),
        pytest.param(["ab", "abcd"], "abcdef", 4, {"a": 2.0}, id="deepest_key_counts"),
    ],
)
def test_match_reports_the_earlier_key_it_continues(inserts, query, end, used) -> None:
    """`end` and `ends` name the deepest earlier key the query continues, and who holds it."""
    tree = PrefixTree(10_000)
    for i, key in enumerate(inserts):
        tree.insert(key, "a", now=float(i + 1))
    found = tree.match(query)
    assert found.end == end
    assert found.ends == used


@pytest.mark.parametrize("kind", ["text", "tokens"])
@pytest.mark.parametrize("max_size", [1_000_000, 3_000], ids=["budgets_bind", "bound_binds"])
def test_invariants_hold_under_random_operations(kind: str, max_size: int) -> None:
    """Random inserts (with and without budgets), matches, TTL expiry and removals: the
    accounting and ordering invariants hold after every step, no server exceeds its budget,
    and while only budgets bind a server keeps the whole key it was sent last."""
    rng = random.Random(f"{kind}/{max_size}")
    tree = PrefixTree(max_size, ttl=40.0)
    budgets = {f"w{i}": rng.choice([0, 200, 500, 1200]) for i in range(5)}
    stems = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 30))) for _ in range(12)]
    unit = 1 if kind == "text" else CHARS_PER_TOKEN
    for step in range(1500):
        text = rng.choice(stems) + "".join(rng.choice("abcd") for _ in range(rng.randint(0, 60)))
        key = text if kind == "text" else tuple(ord(c) for c in text)
        url = rng.choice(list(budgets))
        action = rng.random()
        if action < 0.75:
            tree.insert(key, url, now=float(step), budget=budgets[url])
            if budgets[url]:
                assert tree.server_size(url) <= budgets[url]
            fits = not budgets[url] or len(key) * unit <= budgets[url]
            if max_size == 1_000_000 and fits:
                assert tree.match(key)[url] == len(key)
        elif action < 0.97:
            found = tree.match(key)
            assert all(0 < n <= len(key) for n in found.values())
        else:
            tree.remove_server(url)
            assert url not in tree.server_sizes()
        check_invariants(tree)


def _dump(tree: PrefixTree) -> tuple:
    """The tree as plain values, nodes named by the key that reaches them: its structure,
    holders, ends, accounting and both kinds of LRU order."""
    names: dict = {}
    rows, stack = [], [(tree._root, ())]
    while stack:
        node, name = stack.pop()
        for _, child in sorted(node.children.items(), key=lambda item: item[0]):
            full = name + tuple(child.label)
            names[child] = full
            rows.append((full, dict(child.servers), child.last, child.end, child.size))
            stack.append((child, full))
    return (sorted(rows), tree.size, tree.server_sizes(), [names[n] for n in tree._lru],
            {url: [names[n] for n in lru] for url, lru in tree._lrus.items()})


@pytest.mark.parametrize("kind", ["text", "tokens"])
def test_an_insert_resuming_its_match_builds_the_same_tree(kind: str) -> None:
    """The dispatch's insert resumes the walk of the pick's match of the same key while the
    tree keeps its shape. Twin trees take the same random steps; in one each insert follows a
    match of that very key (sometimes with a removal, eviction or other insert in between,
    which must stop the resume), in the other the key is an equal copy that nothing matched.
    They stay the same, and the first tree's invariants hold."""
    rng = random.Random(kind)
    resumed, walked = PrefixTree(4_000, ttl=30.0), PrefixTree(4_000, ttl=30.0)
    urls = [f"w{i}" for i in range(4)]
    stems = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 20))) for _ in range(8)]

    def key_of(text: str):
        return text if kind == "text" else tuple(ord(c) for c in text)

    def copy(key):
        return (key + "!")[:-1] if kind == "text" else tuple(list(key))

    for step in range(2000):
        text = rng.choice(stems) + "".join(rng.choice("abc") for _ in range(rng.randint(0, 40)))
        key, url, budget = key_of(text), rng.choice(urls), rng.choice([0, 300, 900])
        assert resumed.match(key) == walked.match(copy(key))
        between = rng.random()
        if between < 0.1:  # a removal between the pick and the dispatch
            gone = rng.choice(urls)
            resumed.remove_server(gone)
            walked.remove_server(gone)
        elif between < 0.2:  # another request's insert in between
            other, to = key_of(rng.choice(stems) + rng.choice("abc")), rng.choice(urls)
            resumed.insert(other, to, now=float(step), budget=budget)
            walked.insert(copy(other), to, now=float(step), budget=budget)
        resumed.insert(key, url, now=float(step) + 0.5, budget=budget)
        walked.insert(copy(key), url, now=float(step) + 0.5, budget=budget)
        assert _dump(resumed) == _dump(walked)
        check_invariants(resumed)
