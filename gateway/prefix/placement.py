"""Where a prompt goes when no routing history says, and which of several holders of its
prefix goes first: consistent hashing with bounded loads (a helper, not a policy).

Every worker process (`--workers`) and every gateway replica computes the same order from the
same inputs, without talking to each other: the prompt's anchor (its stable beginning: the
first `ANCHOR` tokens, or `ANCHOR * CHARS_PER_TOKEN` characters of text, so a long system
prompt or document is its own anchor and every conversation on it shares it) is hashed onto a
ring of the servers (or DP ranks), and the first one clockwise whose load is at most
`1 + epsilon` times the average takes it (Mirrokni et al., "Consistent Hashing with Bounded
Loads"). So a conversation's turns meet the server holding its prefix even when they reach
different servers or replicas, a hot prefix spills to the next servers on the ring instead of
swamping one, and it comes back to the first as the load drops.
"""

from __future__ import annotations

import bisect
import zlib
from array import array
from collections.abc import Sequence

from gateway.prefix.tree import CHARS_PER_TOKEN

ANCHOR = 512  # tokens of a prompt that identify it (text: 4 characters a token)
VNODES = 64  # ring points per server: an even share for each
WALKS = 4096  # walks kept per ring, by their starting point (VNODES x 64 targets)


def _hash(data: bytes) -> int:
    return (zlib.crc32(data) << 32) | zlib.adler32(data)


def anchor_of(key: str | tuple[int, ...]) -> bytes:
    """The stable beginning of a routing key, as bytes to hash: the same for every turn of a
    conversation and for every prompt on the same long system prompt or document.

    A rendered chat (`request.render_messages`) is cut at the end of its first user message
    when that comes first: what follows changes from turn to turn."""
    if isinstance(key, str):
        cut = ANCHOR * CHARS_PER_TOKEN
        user = key.find("<|user|>", 0, cut)
        if user >= 0:
            end = key.find("\n<|", user + 8, cut)
            if end > 0:
                cut = end
        return key[:cut].encode()
    try:
        return array("I", key[:ANCHOR]).tobytes()
    except OverflowError:
        return array("q", key[:ANCHOR]).tobytes()


class Ring:
    """The ring of the current targets (servers or DP ranks), by their `url` keys."""

    def __init__(self) -> None:
        self._points: list[int] = []
        self._owners: list[str] = []
        # a walk depends only on the ring and its starting point: each pick asks for its
        # prompt's walk two or three times, and prompts on one anchor start at one point
        self._walks: dict[int, tuple[str, ...]] = {}
        # the last candidates ordered from each starting point, and their order: a pick's
        # candidates are nearly always the same servers as the last pick's from that point
        self._orders: dict[int, tuple[list, list[int]]] = {}

    def rebuild(self, keys: Sequence[str]) -> None:
        pairs = sorted((_hash(f"{key}#{v}".encode()), key) for key in keys for v in range(VNODES))
        self._points = [p for p, _ in pairs]
        self._owners = [k for _, k in pairs]
        self._walks = {}
        self._orders = {}

    def walk(self, anchor: bytes) -> tuple[str, ...]:
        """Every target once, clockwise from the anchor's point."""
        return self._walk_at(self._start(anchor)) if self._points else ()

    def _start(self, anchor: bytes) -> int:
        """The anchor's point: the first ring point clockwise from its hash."""
        return bisect.bisect(self._points, _hash(anchor)) % len(self._points)

    def _walk_at(self, start: int) -> tuple[str, ...]:
        walk = self._walks.get(start)
        if walk is None:
            walk = self._walk_from(start)
            if len(self._walks) < WALKS:
                self._walks[start] = walk
        return walk

    def _walk_from(self, start: int) -> tuple[str, ...]:
        seen: dict[str, None] = {}
        owners = self._owners
        for i in range(len(owners)):
            seen.setdefault(owners[(start + i) % len(owners)])
            if len(seen) * VNODES >= len(owners):
                break
        return tuple(seen)

    def order(self, anchor: bytes, candidates: Sequence) -> list[int]:
        """Indices of `candidates` in ring order from the anchor, those not on the ring left
        out: computed once per pick, then walked by `first`, `place` and `load.spread`
        (read only: the same list answers the next pick from that point over the same
        candidates, told by identity, a comparison in C)."""
        if not self._points:
            return []
        start = self._start(anchor)
        known = self._orders.get(start)
        if known is not None and known[0] == candidates:
            return known[1]
        get = {c.url: i for i, c in enumerate(candidates)}.get
        order = [i for url in self._walk_at(start) if (i := get(url)) is not None]
        if known is not None or len(self._orders) < WALKS:
            self._orders[start] = (list(candidates), order)
        return order


def first(order: Sequence[int], loads: Sequence[float], epsilon: float,
          among: Sequence[bool]) -> int | None:
    """Index of the first candidate of `among` in `order` (`Ring.order`) whose load is within
    the bound of `place`; None if every one of them is over it."""
    bound = _bound(loads, epsilon)
    for i in order:
        if among[i] and loads[i] <= bound:
            return i
    return None


def place(order: Sequence[int], loads: Sequence[float], epsilon: float,
          room: Sequence[bool] | None = None) -> int | None:
    """Index of the candidate to take: the first in `order` (`Ring.order`) whose load is at
    most (1 + epsilon) x the average (+1, so an idle fleet is never full), among those with
    `room` in their cache first, when given; None when `order` is empty."""
    bound = _bound(loads, epsilon)
    fallback = None
    for i in order:
        if loads[i] <= bound:
            if room is None or room[i]:
                return i
            if fallback is None:
                fallback = i
    if fallback is not None:
        return fallback
    return order[0] if order else None


def _bound(loads: Sequence[float], epsilon: float) -> float:
    """(1 + epsilon) x the average load, +1 so that an idle fleet is never full."""
    return (1.0 + epsilon) * (sum(loads) / len(loads)) + 1.0
