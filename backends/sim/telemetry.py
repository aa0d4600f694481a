"""Latency histograms and failure counters of one sim server, fed by the flows.

Apart from `metrics.py` (which renders the page from the whole `SimState`) so that the state
can own its telemetry without the renderer and the state importing each other.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

from backends.sim.config import SimConfig
from backends.sim.job import Job

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 15.0, 20.0, 25.0, 30.0)
_ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04,
                0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.0)
_E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0,
                80.0, 100.0, 200.0, 400.0)


class Histogram:
    def __init__(self, name: str, doc: str, buckets: tuple[float, ...]) -> None:
        self.name, self.doc, self.buckets = name, doc, buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def render(self, labels: str) -> Iterable[str]:
        yield f"# HELP {self.name} {self.doc}"
        yield f"# TYPE {self.name} histogram"
        running = 0
        for bound, count in zip(self.buckets, self.counts, strict=False):
            running += count
            yield f'{self.name}_bucket{{{labels},le="{bound}"}} {running}'
        yield f'{self.name}_bucket{{{labels},le="+Inf"}} {self.n}'
        yield f"{self.name}_sum{{{labels}}} {self.total}"
        yield f"{self.name}_count{{{labels}}} {self.n}"


class Telemetry:
    """Latency histograms and failure counters of one server."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.ttft = Histogram("sglang:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", _TTFT_BUCKETS)
        self.itl = Histogram("sglang:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", _ITL_BUCKETS)
        self.e2e = Histogram("sglang:e2e_request_latency_seconds",
                             "Histogram of End-to-end request latency in seconds", _E2E_BUCKETS)
        self.bootstrap_failed = 0
        self.transfer_failed = 0
        self.aborted = 0

    def observe_failure(self, message: str) -> None:
        if message.startswith(("Prefill bootstrap failed", "Decode handshake failed")):
            self.bootstrap_failed += 1
        elif message.startswith("Decode transfer failed"):
            self.transfer_failed += 1

    def observe_finished(self, job: Job) -> None:
        if job.finished_at is None:
            return
        self.e2e.observe(job.finished_at - job.created)
        if job.first_token_at is not None:
            self.ttft.observe(job.first_token_at - job.created)
            n = len(job.output_ids)
            if n > 1:
                self.itl.observe((job.finished_at - job.first_token_at) / (n - 1))
