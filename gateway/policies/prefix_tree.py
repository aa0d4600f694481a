"""An approximate prefix index: which worker was sent which prompt prefix (a helper, not a policy).

A radix tree over routing keys, either strings (compared by characters) or token-id tuples. Token
tuples are stored as `array('I')` (4 bytes a token, compared with memcmp; a tuple costs 8 bytes
a slot plus an int object a token and compares item by item, ~8x slower). Edge labels are slices
of the inserted keys, so a node costs one Python object however long its label; children are
keyed by the first item of their label, so match and insert are O(len(key)) of C-level slice
comparisons plus O(depth) Python steps.

Each node records the workers whose requests went through it and when it was last used. The
memory bound is ONE number for the whole tree: the characters/tokens stored summed over workers
(a label of 100 characters sent to 3 workers counts 300), which is what the servers' caches hold
between them. Over the bound, least recently used leaves go first.

Invariants that keep eviction O(1) per node:
- a child's workers are a subset of its parent's (insert adds the worker along the whole path);
- in the LRU order every node is older than its ancestors (insert touches the path leaf first),
  so the oldest node is always a leaf and can be dropped without orphaning anything.
"""

from __future__ import annotations

import time
from array import array
from collections import OrderedDict

Key = str | tuple[int, ...]
_Stored = str | array


class _Node:
    __slots__ = ("label", "parent", "children", "workers", "last")

    def __init__(self, label: _Stored, parent: _Node | None) -> None:
        self.label = label
        self.parent = parent
        self.children: dict[object, _Node] = {}
        self.workers: set[str] = set()
        self.last = 0.0


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
    """Radix tree of routed prefixes with one global size bound and LRU leaf eviction."""

    def __init__(self, max_size: int, ttl: float = 0.0) -> None:
        self.max_size = max_size
        self.ttl = ttl  # seconds an unused node survives; 0 keeps it until the size bound
        self._root = _Node("", None)
        self._lru: OrderedDict[_Node, None] = OrderedDict()
        self._size = 0
        self._per_worker: dict[str, int] = {}
        self._memo: tuple[object, _Stored] = ("", "")

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
        """Characters/tokens stored, summed over workers (never above `max_size`)."""
        return self._size

    @property
    def node_count(self) -> int:
        return len(self._lru)

    def worker_sizes(self) -> dict[str, int]:
        return dict(self._per_worker)

    def match(self, key: Key) -> dict[str, int]:
        """For each worker, the length of the longest prefix of `key` it was sent."""
        key = self._stored(key)
        result: dict[str, int] = {}
        node, pos, end = self._root, 0, len(key)
        while pos < end:
            child = node.children.get(key[pos])
            if child is None:
                break
            matched = _common_length(child.label, key, pos)
            pos += matched
            for url in child.workers:
                result[url] = pos
            if matched < len(child.label):
                break
            node = child
        return result

    def insert(self, key: Key, url: str, now: float | None = None) -> None:
        """Record that `key` was sent to `url`; evicts to stay within the bound."""
        if now is None:
            now = time.monotonic()
        key = self._stored(key)
        if len(key) > self.max_size:
            key = key[:self.max_size]
        path: list[_Node] = []
        node, pos, end = self._root, 0, len(key)
        while pos < end:
            child = node.children.get(key[pos])
            if child is None:
                child = _Node(key[pos:], node)
                node.children[key[pos]] = child
                path.append(child)
                break
            matched = _common_length(child.label, key, pos)
            if matched < len(child.label):
                child = self._split(node, child, matched)
            path.append(child)
            pos += matched
            node = child
        lru = self._lru
        for node in reversed(path):  # leaf first: ancestors end up newer than descendants
            if url not in node.workers:
                node.workers.add(url)
                self._size += len(node.label)
                self._per_worker[url] = self._per_worker.get(url, 0) + len(node.label)
            node.last = now
            lru[node] = None
            lru.move_to_end(node)
        self._evict(now)

    def remove_worker(self, url: str) -> None:
        """Forget everything sent to `url` (a removed worker)."""
        if url not in self._per_worker:
            return
        stack = [self._root]
        while stack:
            node = stack.pop()
            for child in list(node.children.values()):
                if url not in child.workers:
                    continue  # its subtree cannot hold url either
                if len(child.workers) == 1:
                    self._drop(child)
                else:
                    child.workers.discard(url)
                    self._size -= len(child.label)
                    stack.append(child)
        self._per_worker.pop(url, None)

    @staticmethod
    def _split(parent: _Node, child: _Node, at: int) -> _Node:
        """Cut `child`'s label at `at`; the new upper node takes its place and its workers."""
        upper = _Node(child.label[:at], parent)
        upper.workers = set(child.workers)
        upper.last = child.last
        parent.children[upper.label[0]] = upper
        child.label = child.label[at:]
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

    def _drop(self, node: _Node) -> None:
        """Remove `node` and its subtree (normally a leaf) with their accounting."""
        parent = node.parent
        if parent is not None:
            del parent.children[node.label[0]]
        stack = [node]
        while stack:
            current = stack.pop()
            stack.extend(current.children.values())
            self._lru.pop(current, None)
            size = len(current.label)
            self._size -= size * len(current.workers)
            for url in current.workers:
                left = self._per_worker.get(url, 0) - size
                if left > 0:
                    self._per_worker[url] = left
                else:
                    self._per_worker.pop(url, None)
