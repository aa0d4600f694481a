"""An approximate prefix index: which worker was sent which prompt prefix, and what each worker's
cache likely still holds of it (a helper, not a policy).

A radix tree over routing keys, either strings (compared by characters) or token-id tuples. Token
tuples are stored as `array('I')` (4 bytes a token, compared with memcmp; a tuple costs 8 bytes
a slot plus an int object a token and compares item by item, ~8x slower). Edge labels are slices
of the inserted keys, so a node costs one Python object however long its label; children are
keyed by the first item of their label, so match and insert are O(len(key)) of C-level slice
comparisons plus O(depth) Python steps.

Sizes are in characters; a token counts `CHARS_PER_TOKEN` (4): about the characters of English
text per token, and the bytes of its slot in the array. So one bound means the same memory for
both kinds of key, and a cache size in tokens converts once, whatever the key.

Each node records the workers whose requests went through it, when each last did, and whether
a key ended there (a later key that continues it is a later turn of the same conversation).
Two bounds:
- ONE number for the whole tree (memory): the size stored summed over servers (a label of 100
  characters sent to 3 workers counts 300). Over it, least recently used leaves go first.
- per worker, the budget passed to `insert` (its server's cache): over it, THAT worker's least
  recently used content goes, as its radix cache evicts, so a match for a server is what it
  likely still holds, and `oldest` says how long content survives there.

Invariants that keep eviction O(1) per node:
- a child's servers are a subset of its parent's (insert adds the server along the whole path);
- in the global LRU order every node is older than its ancestors (insert touches the path leaf
  first), so the oldest node is always a leaf and can be dropped without orphaning anything;
- likewise in each worker's own LRU order (the nodes it used), so its oldest node has no child
  it holds: the worker leaves that node alone. The upper node a split creates holds the workers
  of the node it was cut from, but enters only the inserting server's order (an OrderedDict
  cannot insert in the middle); for every other holder it has exactly one child that holder
  holds, and the holder leaves it right after that child (`_release` climbs to it).
"""

from __future__ import annotations

import time
from array import array
from collections import OrderedDict

Key = str | tuple[int, ...]
_Stored = str | array
CHARS_PER_TOKEN = 4  # size units of one token (a character is one)


class _Node:
    __slots__ = ("label", "size", "parent", "children", "servers", "last", "end")

    def __init__(self, label: _Stored, parent: _Node | None, size: int) -> None:
        self.label = label
        self.size = size  # len(label) in size units
        self.parent = parent
        self.children: dict[object, _Node] = {}
        self.servers: dict[str, float] = {}  # server -> when it last used this node
        self.last = 0.0
        self.end = False  # an inserted key ended here


class Match(dict):
    """Per server, the length of the longest prefix of the key it was sent; `end`: where the
    deepest earlier key on that path ended (0: none); `ends`: the workers holding that key,
    each with when it was last sent it (read only)."""

    __slots__ = ("end", "ends")


_NO_ENDS: dict[str, float] = {}
_NO_WALK: tuple = (None, (), 0)  # no walk to resume (its path is never taken)


def _common_length(label: _Stored, key: _Stored, pos: int) -> int:
    """Length of the common prefix of `label` and `key[pos:]`; the first items are known equal."""
    size = len(label)
    rest = len(key) - pos
    if rest >= size:
        if key[pos:pos + size] == label:
            return size
        high = size - 1
    else:
        high = rest
    low = 1  # label[:low] == key[pos:pos + low]; binary search keeps slice compares in C
    while low < high:
        mid = (low + high + 1) // 2
        if key[pos:pos + mid] == label[:mid]:
            low = mid
        else:
            high = mid - 1
    return low


class PrefixTree:
    """Radix tree of routed prefixes: a global size bound, per-server budgets, LRU eviction."""

    def __init__(self, max_size: int, ttl: float = 0.0) -> None:
        self.max_size = max_size
        self.ttl = ttl  # seconds an unused node survives; 0 keeps it until the size bound
        self._root = _Node("", None, 0)
        self._lru: OrderedDict[_Node, None] = OrderedDict()
        self._lrus: dict[str, OrderedDict[_Node, None]] = {}  # per server, its nodes
        self._size = 0
        self._per_server: dict[str, int] = {}
        self._memo: tuple[object, _Stored] = ("", "")
        # the last match's walk: (stored key, nodes matched whole, items they cover); the
        # next insert, if of that key, resumes from its end (the pick matches a prompt and
        # the dispatch inserts it: a conversation's path is walked once, not twice). Only
        # `insert` and `remove_server` change the tree, and each drops it.
        self._walked: tuple = _NO_WALK

    def _stored(self, key: Key) -> _Stored:
        """The stored form of `key`; remembers the last one (pick and dispatch pass the same)."""
        if isinstance(key, str):
            return key
        source, stored = self._memo
        if source is key:
            return stored
        try:
            stored = array("I", key)
        except OverflowError:  # ids beyond uint32 never occur in practice; stay correct anyway
            stored = array("q", key)
        self._memo = (key, stored)
        return stored

    @property
    def size(self) -> int:
        """Size stored, summed over servers (never above `max_size`)."""
        return self._size

    @property
    def node_count(self) -> int:
        return len(self._lru)

    def server_sizes(self) -> dict[str, int]:
        return dict(self._per_server)

    def server_size(self, url: str) -> int:
        return self._per_server.get(url, 0)

    def oldest(self, url: str) -> float | None:
        """When `url` last used its least recently used content (None: it holds nothing)."""
        own = self._lrus.get(url)
        return next(iter(own)).servers[url] if own else None

    def stale(self, url: str, before: float, limit: int) -> int:
        """Size of `url`'s content last used before `before`, what it can evict without loss
        (its least recently used nodes, at most `limit` of them counted)."""
        total = 0
        for node in self._lrus.get(url, ()):
            if limit <= 0 or node.servers[url] >= before:
                break
            total += node.size
            limit -= 1
        return total

    def match(self, key: Key) -> Match:
        """For each worker, the length of the longest prefix of `key` it was sent."""
        key = self._stored(key)
        result = Match()
        end_at, end_node = 0, None
        path: list[_Node] = []
        node, pos, end = self._root, 0, len(key)
        while pos < end:
            child = node.children.get(key[pos])
            if child is None:
                break
            matched = _common_length(child.label, key, pos)
            for url in child.servers:
                result[url] = pos + matched
            if matched < len(child.label):
                break
            pos += matched
            path.append(child)
            if child.end:
                end_at, end_node = pos, child
            node = child
        self._walked = (key, path, pos)
        result.end = end_at
        result.ends = _NO_ENDS if end_node is None else end_node.servers
        return result

    def insert(self, key: Key, url: str, now: float | None = None, budget: int = 0) -> None:
        """Record that `key` was sent to `url`; evicts to stay within the bound and, when
        `budget` (size units) is given, `url`'s content within its budget."""
        if now is None:
            now = time.monotonic()
        key = self._stored(key)
        unit = 1 if isinstance(key, str) else CHARS_PER_TOKEN
        limit = min(self.max_size, budget) if budget > 0 else self.max_size
        if len(key) * unit > limit:
            key = key[:limit // unit]  # a cache cannot hold more than its size: keep the head
        walked, self._walked = self._walked, _NO_WALK
        if walked[0] is key:  # resume the match's walk
            path: list[_Node] = walked[1]
            node, pos = (path[-1] if path else self._root), walked[2]
        else:
            path, node, pos = [], self._root, 0
        end = len(key)
        while pos < end:
            child = node.children.get(key[pos])
            if child is None:
                child = _Node(key[pos:], node, (end - pos) * unit)
                node.children[key[pos]] = child
                path.append(child)
                break
            matched = _common_length(child.label, key, pos)
            if matched < len(child.label):
                child = self._split(node, child, matched, unit)
            path.append(child)
            pos += matched
            node = child
        if not path:
            return
        path[-1].end = True
        lru = self._lru
        own = self._lrus.get(url)
        if own is None:
            own = self._lrus[url] = OrderedDict()
        added = 0
        for node in reversed(path):  # leaf first: ancestors end up newer than descendants
            servers = node.servers
            if url not in servers:
                added += node.size
            servers[url] = now
            node.last = now
            lru[node] = None
            lru.move_to_end(node)
            own[node] = None
            own.move_to_end(node)
        if added:
            self._size += added
            self._per_server[url] = self._per_server.get(url, 0) + added
        if budget > 0:
            while self._per_server.get(url, 0) > budget and own:
                self._release(next(iter(own)), url)
        self._evict(now)

    def remove_server(self, url: str) -> None:
        """Forget everything sent to `url` (a removed server)."""
        self._walked = _NO_WALK
        if url not in self._lrus:
            return
        stack = [self._root]
        while stack:
            node = stack.pop()
            for child in list(node.children.values()):
                if url not in child.servers:
                    continue  # its subtree cannot hold url either
                if len(child.servers) == 1:
                    self._drop(child)
                else:
                    del child.servers[url]
                    self._size -= child.size
                    stack.append(child)
        self._per_server.pop(url, None)
        self._lrus.pop(url, None)

    @staticmethod
    def _split(parent: _Node, child: _Node, at: int, unit: int) -> _Node:
        """Cut `child`'s label at `at`; the new upper node takes its place and its servers."""
        upper = _Node(child.label[:at], parent, at * unit)
        upper.servers = dict(child.servers)
        upper.last = child.last
        parent.children[upper.label[0]] = upper
        child.label = child.label[at:]
        child.size -= upper.size
        child.parent = upper
        upper.children[child.label[0]] = child
        return upper

    def _evict(self, now: float) -> None:
        lru = self._lru
        cutoff = now - self.ttl if self.ttl > 0 else None
        while lru:
            oldest = next(iter(lru))
            if self._size <= self.max_size and (cutoff is None or oldest.last >= cutoff):
                return
            self._drop(oldest)

    def _account(self, url: str, delta: int) -> None:
        left = self._per_server.get(url, 0) + delta
        if left > 0:
            self._per_server[url] = left
        else:  # holds nothing: its (empty) order goes too
            self._per_server.pop(url, None)
            self._lrus.pop(url, None)

    def _release(self, node: _Node, url: str) -> None:
        """`url` leaves `node`, which has no child `url` holds; then the split-made ancestors
        that held `url` only through it. A node nobody holds goes (it has no children)."""
        own = self._lrus.get(url, {})
        while True:
            own.pop(node, None)
            del node.servers[url]
            self._size -= node.size
            self._account(url, -node.size)
            parent = node.parent
            if not node.servers:
                del parent.children[node.label[0]]
                self._lru.pop(node, None)
            if parent is self._root or url not in parent.servers or parent in own:
                return
            node = parent

    def _drop(self, node: _Node) -> None:
        """Remove `node` and its subtree (normally a leaf) with their accounting."""
        parent = node.parent
        del parent.children[node.label[0]]
        stack = [node]
        while stack:
            current = stack.pop()
            stack.extend(current.children.values())
            self._lru.pop(current, None)
            self._size -= current.size * len(current.servers)
            for url in current.servers:
                own = self._lrus.get(url)
                if own is not None:
                    own.pop(current, None)
                self._account(url, -current.size)
        for url in node.servers:  # a split-made parent held url only through node
            if (parent is not self._root and url in parent.servers
                    and parent not in self._lrus.get(url, ())):
                self._release(parent, url)
