"""The approximate prefix index: matching, one global bound, LRU leaf eviction, worker removal."""

from __future__ import annotations

import random

import pytest

from gateway.policies.prefix_tree import PrefixTree


def check_invariants(tree: PrefixTree) -> None:
    """Accounting equals a recount; children hold subsets of workers; parents are newer."""
    order = {node: i for i, node in enumerate(tree._lru)}
    size, per_worker, stack = 0, {}, [tree._root]
    while stack:
        node = stack.pop()
        for child in node.children.values():
            assert child.parent is node
            assert child.label[0] == next(k for k, c in node.children.items() if c is child)
            assert child.workers and (node is tree._root or child.workers <= node.workers)
            if node is not tree._root:
                assert order[child] < order[node]
            size += len(child.label) * len(child.workers)
            for url in child.workers:
                per_worker[url] = per_worker.get(url, 0) + len(child.label)
            stack.append(child)
    assert size == tree.size <= tree.max_size
    assert per_worker == tree.worker_sizes()
    assert len(order) == tree.node_count


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
    assert tree.size == 20 and tree.worker_sizes() == {"a": 10, "b": 10}


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
    tree.remove_worker("a")
    assert tree.match("shared prefix then a") == {"b": 19}
    assert tree.match("only a") == {}
    assert tree.worker_sizes() == {"b": 20}
    check_invariants(tree)
    tree.remove_worker("missing")  # no-op
    tree.remove_worker("b")
    assert tree.size == 0 and tree.node_count == 0
