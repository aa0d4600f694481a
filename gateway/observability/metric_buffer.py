"""Per-request metric updates that cost a float addition, published to prometheus_client in
bulk.

The request path updates about nine counters and histograms per request. Through
prometheus_client each costs a lock (0.4 us a counter, 0.8 us a histogram here), and with
`--workers` (its multiprocess mode) an mmap write under a lock as well (1.6 us and 2.6 us):
about 16 us per request, a tenth of its CPU. So the hot metrics are buffered: `inc` and
`observe` only add to plain numbers in this process, and `flush()` hands the sums to
prometheus_client, every second (`Metrics.run_flusher`) and before every read of the registry
(/metrics, the status page), so a scrape of this process is exact and another worker's
figures are at most a second old. A worker that crashes loses at most its last second.

A histogram is flushed by bucket: one `inc(n)` per bucket that moved and one for the sum,
on the histogram child's bucket and sum values (`_buckets`, `_sum`, as `observe` updates
them; prometheus_client has no bulk observe). tests/unit/observability/test_metric_buffer.py
checks that the exposition equals what `observe` gives, so a change there fails a test, not a
dashboard.
"""

from __future__ import annotations

from bisect import bisect_left


class BufferedCounter:
    """A counter child's increments since the last flush. The request path adds to
    `pending` itself (`counter.pending += n`, what `inc` does): about twelve updates per
    request, and a call each was 3% of the request path's instructions."""

    __slots__ = ("child", "pending")

    def __init__(self, child) -> None:
        self.child = child
        self.pending = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.pending += amount

    def flush(self) -> None:
        if self.pending:
            amount, self.pending = self.pending, 0.0
            self.child.inc(amount)


class BufferedHistogram:
    __slots__ = ("child", "bounds", "counts", "total", "moved")

    def __init__(self, child) -> None:
        self.child = child
        self.bounds = list(child._upper_bounds)  # ends with +Inf: every value has a bucket
        self.counts = [0] * len(self.bounds)
        self.total = 0.0
        self.moved = False

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # first bound >= value, as observe
        self.total += value
        self.moved = True

    def flush(self) -> None:
        if not self.moved:
            return
        counts, total = self.counts, self.total
        self.counts, self.total, self.moved = [0] * len(self.bounds), 0.0, False
        child = self.child
        child._sum.inc(total)
        for bucket, count in zip(child._buckets, counts, strict=True):
            if count:
                bucket.inc(count)


class MetricBuffer:
    """Every buffered metric child of one process."""

    def __init__(self) -> None:
        self._children: list[BufferedCounter | BufferedHistogram] = []

    def counter(self, child) -> BufferedCounter:
        buffered = BufferedCounter(child)
        self._children.append(buffered)
        return buffered

    def histogram(self, child) -> BufferedHistogram:
        buffered = BufferedHistogram(child)
        self._children.append(buffered)
        return buffered

    def discard(self, buffered: BufferedCounter | BufferedHistogram) -> None:
        """No longer flushed (its series left with its server)."""
        if buffered in self._children:
            self._children.remove(buffered)

    def flush(self) -> None:
        for child in self._children:
            child.flush()
