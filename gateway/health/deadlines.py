"""Adaptive deadlines: how long a server may stay silent before the gateway suspects a hang.

A fixed deadline is either long (600 s: a hung server holds requests for minutes) or short (a
long prefill on a healthy server is cut). So the gateway learns, per server, how long it
normally takes:

* first progress of an attempt (its prefill answer or its decode's first byte, whichever comes
  first), per prompt-size bucket (powers of two of prompt tokens): a prefill's time grows
  with the prompt;
* the gap between two streamed chunks of a decode.

A deadline is `factor` x the `percentile` of the recent observations (a ring of `window`
values), at least `floor`, at most the configured hard timeout. Until a bucket has
`min_samples` observations, the nearest smaller bucket of the same server counts, scaled by
the prompt-size ratio (prefill time is at most linear in the prompt), else the same bucket of
any server, else `cold` plus the prompt at a slow `cold_tokens_per_second` (`gap_cold` for
stream gaps, which any server's gaps also inform). How the defaults were chosen is in docs/RELIABILITY.md.

A request that already waited out silences (`urgency`: its attempts cut for silence and its
stalled streams) has deadlines whose floor halves with each one, down to `urgent_share` of it:
the floor guards against a healthy server's jitter, and a request that met hung servers in turn
would otherwise pay the whole floor at each (soak seed 22: 30.3 s for an answer that met four).
The learned part (`factor` x the percentile) is kept: a long prefill is not cut for it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class DeadlineOptions:
    percentile: float = 0.99
    factor: float = 4.0
    floor: float = 5.0  # seconds: below this, normal jitter (GC, a batch boundary) would cut
    urgent_share: float = 0.2  # the least floor after a request's earlier silences (1 s)
    cold: float = 10.0  # seconds, before anything was learned of first progress (short prompt)
    cold_tokens_per_second: float = 2000.0  # ...plus the prompt at this (slow) prefill speed
    gap_cold: float = 10.0  # seconds, before any stream gap was learned
    min_samples: int = 8
    window: int = 256


class _Ring:
    """The last `size` observations and their cached percentile."""

    __slots__ = ("values", "count", "skip", "_cached", "_dirty")

    def __init__(self, size: int) -> None:
        self.values: deque[float] = deque(maxlen=size)  # the oldest drops out (in C)
        self.count = 0
        self.skip = 0  # observations to pass over before the next is kept (a sampling ring)
        self._cached = 0.0
        self._dirty = 0

    def add(self, value: float) -> bool:
        """Keep `value`; True when this one makes the cached percentile due for a new sort."""
        self.values.append(value)
        self.count += 1
        self._dirty += 1
        return self._dirty == 16 or self.count <= 64

    def quantile(self, q: float) -> float:
        """The q-quantile, recomputed every 16 new observations (a sort of <= 256 floats)."""
        if self._dirty >= 16 or (self._dirty and self.count <= 64):
            ordered = sorted(self.values)
            self._cached = ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]
            self._dirty = 0
        return self._cached


def bucket_of(tokens: int) -> int:
    """Prompt-size bucket: 0 for up to 256 tokens, then one per doubling."""
    bits = (tokens - 1).bit_length() if tokens > 1 else 0  # comparisons: 4 calls a request
    return bits - 8 if bits > 8 else 0


def bucket_tokens(bucket: int) -> int:
    return 256 << bucket


class LatencyModel:
    """Learned first-progress times (per server and prompt bucket) and chunk gaps (per server)."""

    def __init__(self, options: DeadlineOptions | None = None) -> None:
        self.options = options or DeadlineOptions()
        self._first: dict[tuple[str, int], _Ring] = {}
        self._first_any: dict[int, _Ring] = {}
        self._gaps: dict[str, _Ring] = {}
        self._gaps_any = _Ring(self.options.window)
        # (url, bucket) -> (limit, deadline): asked for on every attempt, while what it is
        # made of changes at most every 16 observations of a ring (`_Ring.quantile`); the
        # observation that makes a ring due for a new quantile clears it
        self._memo: dict[tuple[str, int], tuple[float, float]] = {}

    def _ring(self, table: dict, key) -> _Ring:
        ring = table.get(key)
        if ring is None:
            ring = table[key] = _Ring(self.options.window)
        return ring

    # -- observations ----------------------------------------------------------------------

    def first_progress(self, url: str, tokens: int, seconds: float) -> None:
        bucket = bucket_of(tokens)
        stale = self._ring(self._first, (url, bucket)).add(seconds)
        if self._ring(self._first_any, bucket).add(seconds) or stale:
            self._memo.clear()  # a deadline made of either ring may change

    def gaps_of(self, url: str) -> _Ring:
        """The ring of `url`'s chunk gaps, which a stream's relay feeds (`gap`)."""
        ring = self._gaps.get(url)
        if ring is None:
            ring = self._gaps[url] = _Ring(self.options.window)
        return ring

    def gap(self, ring: _Ring, seconds: float) -> None:
        """One chunk gap of a stream from the server of `ring` (`gaps_of`). Per streamed
        chunk, so the caller counts `ring.skip` down itself and calls only when it is 0:
        once the server has `min_samples` gaps, one gap in 4 is kept (its ring then spans
        its last 1024 gaps, plenty for a percentile); the fallback over all servers takes
        one kept gap in 8."""
        ring.add(seconds)
        if ring.count & 7 == 1:
            self._gaps_any.add(seconds)
        if ring.count >= self.options.min_samples:
            ring.skip = 3

    # -- deadlines ----------------------------------------------------------------------------

    def floor(self, urgency: int = 0) -> float:
        """The least deadline of a request with `urgency` earlier silences."""
        o = self.options
        if urgency <= 0:
            return o.floor
        return max(self.least_floor(), o.floor / (1 << min(urgency, 16)))

    def least_floor(self) -> float:
        """The floor of the most urgent request: a wait this long is a silence of its own."""
        return self.options.floor * self.options.urgent_share

    def _bounded(self, learned: float | None, limit: float, cold: float | None = None,
                 urgency: int = 0) -> float:
        o = self.options
        floor = self.floor(urgency)
        if learned is None:
            return min(limit, max(o.cold if cold is None else cold, floor))
        return min(limit, max(floor, o.factor * learned))

    def first_progress_deadline(self, url: str, tokens: int, limit: float,
                                urgency: int = 0) -> float:
        bucket = bucket_of(tokens)
        key = (url, bucket)
        known = self._memo.get(key) if not urgency else None  # (urgent ones are rare)
        if known is not None and known[0] == limit:
            return known[1]
        o = self.options
        learned = self._learned_first(url, bucket)
        if learned is None:  # cold: the prompt's own size counts, not its bucket's
            return self._bounded(None, limit, o.cold + tokens / o.cold_tokens_per_second)
        deadline = self._bounded(learned, limit, urgency=urgency)
        if not urgency:
            self._memo[key] = (limit, deadline)
        return deadline

    def _learned_first(self, url: str, bucket: int) -> float | None:
        """The percentile learned for `url` and the bucket (a smaller bucket's scaled up),
        else every server's for the bucket, else None."""
        o = self.options
        for below in range(bucket, -1, -1):
            ring = self._first.get((url, below))
            if ring is not None and ring.count >= o.min_samples:
                return ring.quantile(o.percentile) * (bucket_tokens(bucket) / bucket_tokens(below))
        ring = self._first_any.get(bucket)
        if ring is not None and ring.count >= o.min_samples:
            return ring.quantile(o.percentile)
        return None

    def gap_deadline(self, url: str, limit: float, urgency: int = 0) -> float:
        """This server's gaps, else every server's (decode steps are alike), else cold."""
        gap = self._learned_gap(url)
        return self._bounded(gap, limit, None if gap is not None else self.options.gap_cold,
                             urgency)

    def answer_deadline(self, url: str, tokens: int | None, limit: float,
                        urgency: int = 0) -> float:
        """How long a decode may stay silent on a non-streamed request once its KV is there:
        it generates `tokens` (the request's budget) at its learned gap per token, so
        `factor` x gap x (tokens + 1), bounded as any deadline. `limit` when the request sets
        no budget or no gap was learned yet: a long answer must not pass for a hang."""
        gap = self._learned_gap(url) if tokens is not None else None
        if gap is None:
            return limit
        return self._bounded(gap * (tokens + 1), limit, urgency=urgency)

    def _learned_gap(self, url: str) -> float | None:
        o = self.options
        for ring in (self._gaps.get(url), self._gaps_any):
            if ring is not None and ring.count >= o.min_samples:
                return ring.quantile(o.percentile)
        return None

    def forget(self, url: str) -> None:
        self._memo.clear()
        for key in [k for k in self._first if k[0] == url]:
            del self._first[key]
        self._gaps.pop(url, None)

    def snapshot(self, url: str) -> dict:
        """What was learned of one server, for the admin API."""
        o = self.options
        first = {bucket_tokens(b): round(r.quantile(o.percentile), 4)
                 for (u, b), r in self._first.items() if u == url and r.count >= o.min_samples}
        gaps = self._gaps.get(url)
        return {"first_progress_p": first,
                "gap_p": round(gaps.quantile(o.percentile), 4)
                if gaps is not None and gaps.count >= o.min_samples else None}
