"""TTFT and inter-token latency over the last minutes, for the status page's plots.

Computed from the gateway's own histograms (`gateway_time_to_first_token_seconds`,
`gateway_inter_token_latency_seconds`), so the request path does no extra work: every
`WINDOW` seconds (on the wall clock's 10-s marks) a background task stores the cumulative
bucket counts, summed over labels and, with `--workers`, over the worker processes (every
worker keeps the same ring of the same sums, so whichever worker answers the page shows the
gateway). A window's percentiles come from the difference of two snapshots, interpolated
within a bucket as Prometheus' `histogram_quantile` does; the window in progress is the
difference between the last snapshot and the registry now.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from collections.abc import Callable, Iterable

WINDOW = 10.0  # seconds per point
SPAN = 60  # points kept: ten minutes
QUANTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))
SERIES = {"ttft": "gateway_time_to_first_token_seconds",
          "itl": "gateway_inter_token_latency_seconds"}

Buckets = tuple[tuple[float, float], ...]  # (upper bound, cumulative count), ascending


def cumulative(families: Iterable) -> dict[str, Buckets]:
    """Each series' cumulative bucket counts, summed over every label but `le`."""
    wanted = {family: key for key, family in SERIES.items()}
    out: dict[str, Buckets] = {}
    for family in families:
        key = wanted.get(family.name)
        if key is None:
            continue
        sums: dict[float, float] = {}
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                bound = float(sample.labels["le"])
                sums[bound] = sums.get(bound, 0.0) + sample.value
        out[key] = tuple(sorted(sums.items()))
    return out


def quantile(q: float, bounds: list[float], counts: list[float]) -> float | None:
    """`histogram_quantile` over one window's cumulative counts; None without samples."""
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return None
    rank = q * total
    for i, count in enumerate(counts):
        if count >= rank:
            upper = bounds[i]
            lower = bounds[i - 1] if i else 0.0
            if math.isinf(upper):
                return lower  # beyond the last finite bound: that bound, as Prometheus says
            below = counts[i - 1] if i else 0.0
            inside = count - below
            return upper if inside <= 0 else lower + (upper - lower) * (rank - below) / inside
    return bounds[-2] if len(bounds) > 1 else None


def window_point(end: float, before: Buckets | None, after: Buckets) -> dict:
    """One window: its end time, how many samples, and the percentiles (None if empty)."""
    old = dict(before or ())
    bounds = [bound for bound, _ in after]
    counts = [max(0.0, count - old.get(bound, 0.0)) for bound, count in after]
    for i in range(1, len(counts)):  # a restart makes a difference negative: keep it sane
        counts[i] = max(counts[i], counts[i - 1])
    point = {"t": round(end, 3), "count": int(counts[-1]) if counts else 0}
    for name, q in QUANTILES:
        value = quantile(q, bounds, counts)
        point[name] = None if value is None else round(value, 6)
    return point


class LatencyHistory:
    """The ring of snapshots, one per window, and the points the page draws."""

    def __init__(self, read: Callable[[], Iterable], window: float = WINDOW,
                 span: int = SPAN) -> None:
        self.read = read  # the registry's families, published figures included
        self.window = window
        self.ring: collections.deque[tuple[float, dict[str, Buckets]]] = \
            collections.deque(maxlen=span + 1)

    def snapshot(self, now: float | None = None) -> None:
        self.ring.append((time.time() if now is None else now, cumulative(self.read())))

    async def run(self) -> None:
        """Snapshot at every window mark of the wall clock (owned by runtime.Gateway)."""
        self.snapshot()
        while True:
            now = time.time()
            await asyncio.sleep(self.window - now % self.window + 0.05)
            self.snapshot()

    def series(self, families: Iterable, now: float | None = None) -> dict:
        """{"window", "ttft": [points], "itl": [points]}, oldest first; the last point is
        the window in progress, computed from `families` (the registry read now)."""
        now = time.time() if now is None else now
        current = cumulative(families)
        out: dict = {"window": self.window}
        snapshots = list(self.ring)
        for key in SERIES:
            points = []
            for (_, before), (end, after) in zip(snapshots, snapshots[1:], strict=False):
                if key in after:
                    points.append(window_point(end, before.get(key), after[key]))
            if key in current:
                before = snapshots[-1][1].get(key) if snapshots else None
                points.append(window_point(now, before, current[key]))
            out[key] = points
        return out
