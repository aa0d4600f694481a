"""Prometheus text for GET /metrics, with SGLang's metric names and labels.

Written by hand (no prometheus_client import) to keep each sim light. Gauges
come from the engine at scrape time; latency histograms are fed by the flows.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import TYPE_CHECKING

from backends.sim.config import SimConfig
from backends.sim.job import Job

if TYPE_CHECKING:
    from backends.sim.dp import DpRank
    from backends.sim.state import SimState

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


def _family(name: str, kind: str, doc: str, samples: list[tuple[str, float]]) -> list[str]:
    """One metric family: HELP and TYPE once, then a sample per label set."""
    base = name.removesuffix("_total") if kind == "counter" else name
    return [f"# HELP {base} {doc}", f"# TYPE {base} {kind}",
            *(f"{name}{{{labels}}} {value}" for labels, value in samples)]


def _rank_gauges(state: SimState, rank: DpRank) -> list[tuple[str, str, float]]:
    """The scheduler gauges of one DP rank."""
    cfg, eng = state.config, rank.engine
    jobs = [j for j in state.jobs.values() if j.rank == rank.index]
    bootstrap_q = sum(1 for j in jobs if j.phase == "bootstrap")
    transfer_q = sum(1 for j in jobs if j.phase == "transfer")
    used = eng.num_used_tokens
    return [
        ("sglang:num_running_reqs", "The number of running requests.", eng.num_running),
        ("sglang:num_queue_reqs", "The number of requests in the waiting queue.", len(eng.waiting)),
        ("sglang:num_used_tokens", "The number of used tokens.", used),
        ("sglang:token_usage", "The token usage.", round(used / cfg.max_total_tokens, 6)),
        ("sglang:gen_throughput", "The generation throughput (token/s).", round(eng.gen_throughput, 3)),
        ("sglang:cache_hit_rate", "The prefix cache hit rate.", round(eng.cache_hit_rate, 6)),
        ("sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.",
         cfg.max_total_tokens),
        ("sglang:page_size", "KV cache page size.", cfg.page_size),
        ("sglang:num_prefill_bootstrap_queue_reqs",
         "The number of requests in the prefill bootstrap queue.",
         bootstrap_q if cfg.mode == "prefill" else 0),
        ("sglang:num_prefill_inflight_queue_reqs",
         "The number of requests in the prefill inflight queue.", len(eng.inflight)),
        ("sglang:num_decode_prealloc_queue_reqs",
         "The number of requests in the decode prealloc queue.",
         bootstrap_q if cfg.mode == "decode" else 0),
        ("sglang:num_decode_transfer_queue_reqs",
         "The number of requests in the decode transfer queue.",
         transfer_q if cfg.mode == "decode" else 0),
    ]


def render_metrics(state: SimState) -> str:
    """The whole /metrics page.

    Scheduler gauges come once per DP rank; with more than one rank they carry a
    `dp_rank` label, as SchedulerMetricsCollector's labels do when the scheduler has a
    dp_rank (observability/metrics_collector.py). The tokenizer's counters and
    histograms are per server.
    """
    cfg = state.config
    common = f'model_name="{cfg.model_name}",engine_type="{cfg.engine_type}"'
    sched = f'{common},tp_rank="0",pp_rank="0",moe_ep_rank="0"'
    labelled = cfg.num_dp_ranks > 1
    per_rank = [(f'{sched},dp_rank="{r.index}"' if labelled else sched, _rank_gauges(state, r))
                for r in state.ranks]
    lines: list[str] = []
    for i, (name, doc, _) in enumerate(per_rank[0][1]):
        lines += _family(name, "gauge", doc, [(labels, gauges[i][2]) for labels, gauges in per_rank])
    tel = state.telemetry
    engines = [r.engine for r in state.ranks]
    counters = [
        ("sglang:prompt_tokens_total", "Number of prefill tokens processed.",
         sum(e.prompt_tokens_total for e in engines)),
        ("sglang:generation_tokens_total", "Number of generation tokens processed.",
         sum(e.generation_tokens_total for e in engines)),
        ("sglang:cached_tokens_total", "Number of cached prompt tokens.",
         sum(e.cached_tokens_total for e in engines)),
        ("sglang:num_requests_total", "Number of requests processed.",
         sum(e.requests_total for e in engines)),
        ("sglang:num_aborted_requests_total", "Number of requests aborted.", tel.aborted),
        ("sglang:num_bootstrap_failed_reqs_total", "Number of bootstrap failed requests.",
         tel.bootstrap_failed),
        ("sglang:num_transfer_failed_reqs_total", "Number of transfer failed requests.",
         tel.transfer_failed),
    ]
    for name, doc, value in counters:
        lines += _family(name, "counter", doc, [(common, value)])
    for hist in (tel.ttft, tel.itl, tel.e2e):
        lines += list(hist.render(common))
    return "\n".join(lines) + "\n"
