"""Prometheus text for GET /metrics, with SGLang's metric names and labels.

Written by hand (no prometheus_client import) to keep each sim light. Gauges
come from the engine at scrape time; latency histograms (`telemetry.py`) are fed by the flows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from backends.sim.dp import DpRank
    from backends.sim.state import SimState


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
