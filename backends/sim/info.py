"""Read-only endpoints: health, model/server info, loads, metrics, and /sim/*."""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from backends.sim.config import SGLANG_VERSION
from backends.sim.dp import DpRank
from backends.sim.metrics import render_metrics
from backends.sim.native import read_json
from backends.sim.requests import BadRequest
from backends.sim.state import SimState

_LOAD_SECTIONS = {"core", "memory", "spec", "lora", "disagg", "queues", "all"}


def _state(request: Request) -> SimState:
    return request.app.state.sim


def _http_error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"object": "error", "message": message, "type": str(status),
                         "param": None, "code": status}, status_code=status)


async def health(request: Request) -> Response:
    return Response(status_code=200 if _state(request).ready else 503)


async def model_info(request: Request) -> Response:
    cfg = _state(request).config
    return JSONResponse({
        "model_path": cfg.model_path, "served_model_name": cfg.model_name,
        "tokenizer_path": cfg.model_path, "is_generation": True,
        "preferred_sampling_params": None, "weight_version": "default", "load_format": "dummy",
        "reasoning_parser": None, "tool_call_parser": None, "disaggregation_mode": cfg.mode,
        "has_image_understanding": False, "has_audio_understanding": False,
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
    })


def _model_card(name: str, context_length: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "sglang",
            "root": name, "parent": None, "max_model_len": context_length}


async def models(request: Request) -> Response:
    cfg = _state(request).config
    return JSONResponse({"object": "list", "data": [_model_card(cfg.model_name, cfg.context_length)]})


async def model_card(request: Request) -> Response:
    cfg = _state(request).config
    name = request.path_params["model"]
    if name != cfg.model_name:
        return JSONResponse({"error": {"message": f"The model '{name}' does not exist",
                                       "type": "invalid_request_error", "param": "model",
                                       "code": "model_not_found"}}, status_code=404)
    return JSONResponse(_model_card(name, cfg.context_length))


def _internal_state(state: SimState, rank: DpRank) -> dict[str, Any]:
    eng = rank.engine
    return {"dp_rank": rank.index, "last_gen_throughput": round(eng.gen_throughput, 3),
            "memory_usage": {"weight": 15.0, "kvcache": 52.0, "token_capacity":
                             state.config.max_total_tokens, "graph": 0.5},
            "num_running_reqs": eng.num_running, "num_waiting_reqs": len(eng.waiting),
            # InternalStateReader._add_disaggregation: what a router feeds back to
            # /pd_role_switch (decode graph phases' memory summed)
            "disaggregation_mode": state.config.mode,
            "decode_cuda_graph_bs": list(state.decode_graph_bs),
            "decode_cuda_graph_memory_gb": 0.5 if state.decode_graph_bs else 0.0}


async def server_info(request: Request) -> Response:
    state = _state(request)
    cfg = state.config
    info: dict[str, Any] = {
        "model_path": cfg.model_path, "tokenizer_path": cfg.model_path,
        "served_model_name": cfg.model_name, "host": cfg.host, "port": cfg.port,
        "skip_tokenizer_init": False, "load_format": "dummy", "dtype": "bfloat16",
        "kv_cache_dtype": "auto", "context_length": cfg.context_length, "device": "cuda",
        # resolved_dict (server_args.py): dp_size counts replicas, attn_dp_size attention-DP
        # groups (tp_size at least that), enable_dp_attention = attn_dp_size > 1
        "tp_size": cfg.attn_dp_size, "pp_size": 1, "dp_size": cfg.dp_size, "ep_size": 1,
        "attn_dp_size": cfg.attn_dp_size, "enable_dp_attention": cfg.attn_dp,
        "page_size": cfg.page_size, "max_running_requests": cfg.max_running_requests,
        "max_total_tokens": cfg.max_total_tokens, "chunked_prefill_size": cfg.chunked_prefill_size,
        "schedule_policy": "fcfs", "stream_interval": 1, "enable_metrics": True,
        "enable_cache_report": cfg.enable_cache_report, "disable_radix_cache": False,
        "load_balance_method": cfg.load_balance_method,
        "enable_priority_scheduling": cfg.enable_priority_scheduling,
        "schedule_low_priority_values_first": cfg.schedule_low_priority_values_first,
        "abort_on_priority_when_disabled": cfg.abort_on_priority_when_disabled,
        # build_server_info: the launch configuration, which a runtime role switch leaves
        # as it was (the live role: /model_info and internal_states)
        "disaggregation_mode": state.launch_mode,
        "disaggregation_transfer_backend": cfg.transfer_backend,
        "disaggregation_bootstrap_port": cfg.bootstrap_port,
        "disaggregation_ib_device": None,
        "disaggregation_decode_enable_radix_cache": False,
        "kv_events_config": cfg.kv_events.raw if cfg.kv_events else None,
        "max_total_num_tokens": cfg.max_total_tokens,
        "max_req_input_len": cfg.max_req_input_len,
        "kv_events": (state.ranks[0].publisher.describe(cfg.num_dp_ranks)
                      if state.ranks[0].publisher else None),
        "startup_time": state.stats.started,
        "internal_states": [_internal_state(state, r) for r in state.ranks],
        "version": SGLANG_VERSION,
        "frontend": "python",
    }
    return JSONResponse(info)


def load_snapshot(state: SimState, rank: DpRank) -> dict[str, Any]:
    """One rank's `LoadSnapshot.to_dict()` entry (managers/load_snapshot.py)."""
    cfg, eng = state.config, rank.engine
    used = eng.num_used_tokens
    phases = [j.phase for j in state.jobs.values() if j.rank == rank.index]
    in_mode = {"prefill": cfg.mode == "prefill", "decode": cfg.mode == "decode"}
    return {
        "timestamp": time.time(), "dp_rank": rank.index,
        "num_running_reqs": eng.num_running, "num_waiting_reqs": len(eng.waiting),
        "num_waiting_uncached_tokens": eng.waiting_uncached_tokens,
        "num_used_tokens": used, "num_total_tokens": eng.num_total_tokens,
        "num_active_tokens": used,
        "num_prealloc_ready_tokens": 0, "max_total_num_tokens": cfg.max_total_tokens,
        "max_running_requests": cfg.max_running_requests,
        "token_usage": round(used / cfg.max_total_tokens, 6),
        "gen_throughput": round(eng.gen_throughput, 3),
        "cache_hit_rate": round(eng.cache_hit_rate, 6),
        "utilization": round(eng.num_running / cfg.max_running_requests, 6),
        "total_prefill_uncached_tokens": eng.prefill_step_tokens_total,
        "total_prefill_busy_us": eng.prefill_busy_us_total, "decode_moments": None,
        "memory": {"weight_gb": 15.0, "kv_cache_gb": 52.0, "graph_gb": 0.5,
                   "token_capacity": cfg.max_total_tokens},
        "disaggregation": {
            "mode": cfg.mode,
            "prefill_bootstrap_queue_reqs": phases.count("bootstrap") if in_mode["prefill"] else 0,
            "prefill_inflight_queue_reqs": len(eng.inflight),
            "decode_prealloc_queue_reqs": phases.count("bootstrap") if in_mode["decode"] else 0,
            "decode_transfer_queue_reqs": phases.count("transfer") if in_mode["decode"] else 0,
            "decode_retracted_queue_reqs": 0, "kv_transfer_speed_gb_s": 0.0,
            "kv_transfer_latency_ms": 0.0,
        },
        "queues": {"waiting": len(eng.waiting), "grammar": 0, "paused": 0, "retracted": 0,
                   "prealloc_ready": 0},
    }


_SECTION_NAMES = {"memory": "memory", "disaggregation": "disagg", "queues": "queues"}


async def loads(request: Request) -> Response:
    """GET /v1/loads[?include=..][&dp_rank=N]: one entry per DP rank (entrypoints/v1_loads.py).

    mirrors TokenizerControlMixin.get_loads: a dp_rank out of range gives no entries.
    """
    state = _state(request)
    include_raw = request.query_params.get("include")
    include = {s.strip() for s in include_raw.split(",")} if include_raw else None
    if include is not None and not include <= _LOAD_SECTIONS:
        return _http_error(400, f"Invalid include sections: {include - _LOAD_SECTIONS}. "
                                f"Valid options: {sorted(_LOAD_SECTIONS)}")
    ranks = state.ranks
    raw_rank = request.query_params.get("dp_rank")
    if raw_rank is not None:
        try:
            wanted = int(raw_rank)
        except ValueError:
            return JSONResponse({"detail": [{
                "type": "int_parsing", "loc": ["query", "dp_rank"], "input": raw_rank,
                "msg": "Input should be a valid integer, unable to parse string as an integer"}]},
                status_code=422)
        ranks = [r for r in ranks if r.index == wanted]
    snaps = [load_snapshot(state, r) for r in ranks]
    if include is not None and "all" not in include:
        for snap in snaps:
            for key, name in _SECTION_NAMES.items():
                if name not in include:
                    snap.pop(key)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())
    # _num_accelerators_per_dp_rank: tp * pp, divided by the ranks under attention DP
    cfg = state.config
    per_rank = cfg.attn_dp_size // cfg.num_dp_ranks if cfg.attn_dp else 1
    return JSONResponse({"timestamp": stamp,
                         "version": SGLANG_VERSION, "accelerator": "SIM H100",
                         "num_accelerators": per_rank, "loads": snaps})


async def metrics(request: Request) -> Response:
    return PlainTextResponse(render_metrics(_state(request)),
                             media_type="text/plain; version=0.0.4; charset=utf-8")


def _rank_stats(state: SimState, rank: DpRank) -> dict[str, Any]:
    """What one DP rank served and holds (tests and benchmarks)."""
    eng, cache = rank.engine, rank.cache
    return {
        "dp_rank": rank.index,
        "dispatched": state.controller.dispatched[rank.index] if state.controller else None,
        "requests": eng.requests_total, "prompt_tokens": eng.prompt_tokens_total,
        "cached_tokens": eng.cached_tokens_total, "running": eng.num_running,
        "waiting": len(eng.waiting),
        "cache": {"size_tokens": cache.size, "capacity_tokens": cache.capacity,
                  "evicted_tokens": cache.evicted_tokens},
        "kv_events_published": rank.publisher.published if rank.publisher else 0,
    }


async def sim_stats(request: Request) -> Response:
    state = _state(request)
    per_rank = [_rank_stats(state, r) for r in state.ranks]
    extra = {
        "faults": state.config.faults.as_dict(),
        "cache": {key: sum(r["cache"][key] for r in per_rank)
                  for key in ("size_tokens", "capacity_tokens", "evicted_tokens")},
        "kv_events_published": sum(r["kv_events_published"] for r in per_rank),
        "dp_ranks": per_rank,
        "rooms_reused": state.stats.rooms_reused + sum(
            r.registry.reused for r in state.ranks if r.registry is not None),
        "role_switches": state.role_switches,
    }
    return JSONResponse(state.stats.snapshot(state.config.mode, len(state.jobs), extra))


async def sim_reset(request: Request) -> Response:
    state = _state(request)
    state.stats.reset()
    for rank in state.ranks:
        if rank.registry is not None:
            rank.registry.reused = 0
    return JSONResponse({"ok": True})


async def sim_faults(request: Request) -> Response:
    state = _state(request)
    if request.method == "POST":
        try:
            body = await read_json(request)
            if not isinstance(body, dict):
                raise BadRequest("body must be a JSON object of fault knobs")
            state.config.faults.update(body)
            if {"slow_start", "slow-start"} & set(body):
                state.started = time.monotonic()  # the slow start counts from now
        except (BadRequest, ValueError, TypeError) as exc:
            return _http_error(400, str(exc))
    return JSONResponse(state.config.faults.as_dict())
