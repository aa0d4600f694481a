"""Where a prompt goes when no routing history says: consistent hashing with bounded loads
(a helper, not a policy).

Every worker process (`--workers`) and every gateway replica computes the same placement from
the same inputs, without talking to each other: the prompt's anchor (its stable beginning:
a chat's system prompt and first user turn, or the first `ANCHOR` characters or tokens) is
hashed onto a ring of the servers (or DP ranks), and the first one clockwise whose load is at
most `1 + epsilon` times the average takes it (Mirrokni et al., "Consistent Hashing with
Bounded Loads"). So a conversation's turns meet the server holding its prefix even when they
reach different workers or replicas, and a hot prefix spills to the next servers on the ring
instead of swamping one.
"""

from __future__ import annotations

import bisect
import zlib
from array import array
from collections.abc import Sequence

ANCHOR = 512  # characters (or tokens) of a prompt that identify it
VNODES = 64  # ring points per server: an even share for each


def _hash(data: bytes) -> int:
    return (zlib.crc32(data) << 32) | zlib.adler32(data)


def anchor_of(key: str | tuple[int, ...]) -> bytes:
    """The stable beginning of a routing key, as bytes to hash.

    A rendered chat (`request.render_messages`) is anchored at the end of its first user
    message, so every later turn of the conversation has the same anchor."""
    if isinstance(key, str):
        user = key.find("<|user|>")
        if user >= 0:
            end = key.find("\n<|", user + 8)
            if end > 0:
                return key[:min(end, user + 8 + ANCHOR * 8)].encode()
        return key[:ANCHOR].encode()
    try:
        return array("I", key[:ANCHOR]).tobytes()
    except OverflowError:
        return array("q", key[:ANCHOR]).tobytes()


class Ring:
    """The ring of the current targets (servers or DP ranks), by their `url` keys."""

    def __init__(self) -> None:
        self._points: list[int] = []
        self._owners: list[str] = []

    def rebuild(self, keys: Sequence[str]) -> None:
        pairs = sorted((_hash(f"{key}#{v}".encode()), key) for key in keys for v in range(VNODES))
        self._points = [p for p, _ in pairs]
        self._owners = [k for _, k in pairs]

    def walk(self, anchor: bytes) -> list[str]:
        """Every target once, clockwise from the anchor's point."""
        if not self._points:
            return []
        start = bisect.bisect(self._points, _hash(anchor)) % len(self._points)
        seen: dict[str, None] = {}
        owners = self._owners
        for i in range(len(owners)):
            seen.setdefault(owners[(start + i) % len(owners)])
            if len(seen) * VNODES >= len(owners):
                break
        return list(seen)

    def place(self, anchor: bytes, candidates: Sequence, loads: Sequence[float],
              epsilon: float, room: Sequence[bool] | None = None) -> int | None:
        """Index of the candidate to take: the first on the ring from the anchor whose load
        is at most (1 + epsilon) x the average (+1, so an idle fleet is never full), among
        those with `room` in their cache first, when given."""
        index = {c.url: i for i, c in enumerate(candidates)}
        bound = (1.0 + epsilon) * (sum(loads) / len(loads)) + 1.0
        first = fallback = None
        for url in self.walk(anchor):
            i = index.get(url)
            if i is None:
                continue
            if first is None:
                first = i
            if loads[i] <= bound:
                if room is None or room[i]:
                    return i
                if fallback is None:
                    fallback = i
        return first if fallback is None else fallback
