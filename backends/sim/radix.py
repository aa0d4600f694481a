"""Per-server prefix cache: a page-granular radix tree with LRU leaf eviction.

Like SGLang's RadixCache: only whole pages are cached, a match never covers
the last prompt token (its logits must be computed), eviction drops whole
least-recently-used leaves, and each insert/eviction/flush is reported as a
BlockStored/BlockRemoved/AllBlocksCleared event when a recorder is attached.
Requests do not lock their prefix: the sim never needs the KV itself.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from backends.sim.blockhash import chain_digests, digest_to_int64


@dataclass
class CacheEvent:
    """One change of the cache, in SGLang's event vocabulary."""

    kind: str  # "BlockStored" | "BlockRemoved" | "AllBlocksCleared"
    block_hashes: list[int]
    parent_block_hash: int | None = None
    token_ids: list[int] | None = None


class _Node:
    __slots__ = ("key", "children", "parent", "last_access", "digests")

    def __init__(self, key: list[int], parent: _Node | None) -> None:
        self.key = key
        self.children: dict[tuple[int, ...], _Node] = {}
        self.parent = parent
        self.last_access = 0
        self.digests: list[bytes] = []


def _common_len(edge: list[int], tokens: list[int], start: int, end: int) -> int:
    """Length of the common prefix of `edge` and `tokens[start:end]`."""
    limit = min(len(edge), end - start)
    i = 0
    step = 64
    while i + step <= limit and edge[i : i + step] == tokens[start + i : start + i + step]:
        i += step
    while i < limit and edge[i] == tokens[start + i]:
        i += 1
    return i


class RadixCache:
    """Token-prefix cache bounded by `capacity` tokens."""

    def __init__(self, page_size: int, capacity: int, record_events: bool = False) -> None:
        self.page_size = page_size
        self.capacity = capacity
        self.record_events = record_events
        self.on_events: Callable[[list[CacheEvent]], None] | None = None
        self._clock = itertools.count(1)
        self._root = _Node([], None)
        self._leaves: set[_Node] = set()
        self.size = 0
        self.evicted_tokens = 0

    def _aligned(self, n: int) -> int:
        return n - n % self.page_size

    def match(self, tokens: list[int]) -> int:
        """Cached prefix length for a prompt (at most len - 1, page-aligned)."""
        limit = self._aligned(max(0, len(tokens) - 1))
        node, pos, tick = self._root, 0, next(self._clock)
        p = self.page_size
        while pos < limit:
            child = node.children.get(tuple(tokens[pos : pos + p]))
            if child is None:
                break
            common = self._aligned(_common_len(child.key, tokens, pos, limit))
            child.last_access = tick
            pos += common
            if common < len(child.key):
                break
            node = child
        return pos

    def insert(self, tokens: list[int]) -> None:
        """Cache the page-aligned prefix of `tokens`, then evict to capacity."""
        if self.capacity <= 0:
            return
        n = self._aligned(len(tokens))
        node, pos, tick = self._root, 0, next(self._clock)
        p = self.page_size
        events: list[CacheEvent] = []
        while pos < n:
            first = tuple(tokens[pos : pos + p])
            child = node.children.get(first)
            if child is None:
                events.append(self._add_leaf(node, first, tokens[pos:n], tick))
                break
            common = self._aligned(_common_len(child.key, tokens, pos, n))
            child.last_access = tick
            if common < len(child.key):
                child = self._split(child, common)
            node = child
            pos += common
        self._evict(events)
        self._emit(events)

    def _add_leaf(self, parent: _Node, first: tuple[int, ...], key: list[int], tick: int) -> CacheEvent:
        leaf = _Node(key, parent)
        leaf.last_access = tick
        parent.children[first] = leaf
        self._leaves.discard(parent)
        self._leaves.add(leaf)
        self.size += len(key)
        parent_hash = None
        if self.record_events:
            prior = parent.digests[-1] if parent.digests else None
            leaf.digests = chain_digests(prior, key, self.page_size)
            parent_hash = digest_to_int64(prior) if prior is not None else None
        return CacheEvent(
            "BlockStored",
            [digest_to_int64(d) for d in leaf.digests],
            parent_block_hash=parent_hash,
            token_ids=list(key),
        )

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut `child`'s edge at `at` tokens; returns the new upper node."""
        parent = child.parent
        assert parent is not None
        p = self.page_size
        upper = _Node(child.key[:at], parent)
        upper.last_access = child.last_access
        upper.digests = child.digests[: at // p]
        parent.children[tuple(child.key[:p])] = upper
        child.key = child.key[at:]
        child.digests = child.digests[at // p :]
        child.parent = upper
        upper.children[tuple(child.key[:p])] = child
        return upper

    def _evict(self, events: list[CacheEvent]) -> None:
        if self.size <= self.capacity:
            return
        heap = [(leaf.last_access, id(leaf), leaf) for leaf in self._leaves]
        heapq.heapify(heap)
        while self.size > self.capacity and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[tuple(leaf.key[: self.page_size])]
            self._leaves.discard(leaf)
            self.size -= len(leaf.key)
            self.evicted_tokens += len(leaf.key)
            if self.record_events and leaf.digests:
                events.append(CacheEvent("BlockRemoved", [digest_to_int64(d) for d in leaf.digests]))
            if parent is not self._root and not parent.children:
                self._leaves.add(parent)
                heapq.heappush(heap, (parent.last_access, id(parent), parent))

    def clear(self) -> None:
        """Drop everything (POST /flush_cache)."""
        self._root = _Node([], None)
        self._leaves.clear()
        self.size = 0
        self._emit([CacheEvent("AllBlocksCleared", [])])

    def _emit(self, events: list[CacheEvent]) -> None:
        if events and self.record_events and self.on_events is not None:
            self.on_events(events)
