"""Read-only endpoints: health, model/server info, loads, metrics, and /sim/*."""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from backends.sim.config import SGLANG_VERSION
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
        "model_path": cfg.model_name, "served_model_name": cfg.model_name,
        "tokenizer_path": cfg.model_name, "is_generation": True,
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


def _internal_state(state: SimState) -> dict[str, Any]:
    eng = state.engine
    return {"dp_rank": 0, "last_gen_throughput": round(eng.gen_throughput, 3),
            "memory_usage": {"weight": 15.0, "kvcache": 52.0, "token_capacity":
                             state.config.max_total_tokens, "graph": 0.5},
            "num_running_reqs": eng.num_running, "num_waiting_reqs": len(eng.waiting)}


async def server_info(request: Request) -> Response:
    state = _state(request)
    cfg = state.config
    info: dict[str, Any] = {
        "model_path": cfg.model_name, "tokenizer_path": cfg.model_name,
        "served_model_name": cfg.model_name, "host": cfg.host, "port": cfg.port,
        "skip_tokenizer_init": False, "load_format": "dummy", "dtype": "bfloat16",
        "kv_cache_dtype": "auto", "context_length": cfg.context_length, "device": "cuda",
        "tp_size": 1, "pp_size": 1, "dp_size": 1, "ep_size": 1,
        "page_size": cfg.page_size, "max_running_requests": cfg.max_running_requests,
        "max_total_tokens": cfg.max_total_tokens, "chunked_prefill_size": cfg.chunked_prefill_size,
        "schedule_policy": "fcfs", "stream_interval": 1, "enable_metrics": True,
        "enable_cache_report": cfg.enable_cache_report, "disable_radix_cache": False,
        "load_balance_method": "round_robin",
        "disaggregation_mode": cfg.mode,
        "disaggregation_transfer_backend": cfg.transfer_backend,
        "disaggregation_bootstrap_port": cfg.bootstrap_port,
        "disaggregation_ib_device": None,
        "disaggregation_decode_enable_radix_cache": False,
        "kv_events_config": cfg.kv_events.raw if cfg.kv_events else None,
        "max_total_num_tokens": cfg.max_total_tokens,
        "max_req_input_len": cfg.context_length - 1,
        "kv_events": state.publisher.describe() if state.publisher else None,
        "startup_time": state.stats.started,
        "internal_states": [_internal_state(state)],
        "version": SGLANG_VERSION,
        "frontend": "python",
    }
    return JSONResponse(info)


def load_snapshot(state: SimState) -> dict[str, Any]:
    """One `LoadSnapshot.to_dict()` entry (managers/load_snapshot.py)."""
    cfg, eng = state.config, state.engine
    used = eng.num_used_tokens
    phases = [j.phase for j in state.jobs.values()]
    in_mode = {"prefill": cfg.mode == "prefill", "decode": cfg.mode == "decode"}
    return {
        "timestamp": time.time(), "dp_rank": 0,
        "num_running_reqs": eng.num_running, "num_waiting_reqs": len(eng.waiting),
        "num_waiting_uncached_tokens": eng.waiting_uncached_tokens,
        "num_used_tokens": used, "num_total_tokens": used, "num_active_tokens": used,
        "num_prealloc_ready_tokens": 0, "max_total_num_tokens": cfg.max_total_tokens,
        "max_running_requests": cfg.max_running_requests,
        "token_usage": round(used / cfg.max_total_tokens, 6),
        "gen_throughput": round(eng.gen_throughput, 3),
        "cache_hit_rate": round(eng.cache_hit_rate, 6),
        "utilization": round(eng.num_running / cfg.max_running_requests, 6),
        "total_prefill_uncached_tokens": eng.prompt_tokens_total - eng.cached_tokens_total,
        "total_prefill_busy_us": 0, "decode_moments": None,
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
    include_raw = request.query_params.get("include")
    include = {s.strip() for s in include_raw.split(",")} if include_raw else None
    if include is not None and not include <= _LOAD_SECTIONS:
        return _http_error(400, f"Invalid include sections: {include - _LOAD_SECTIONS}. "
                                f"Valid options: {sorted(_LOAD_SECTIONS)}")
    snap = load_snapshot(_state(request))
    if include is not None and "all" not in include:
        for key, name in _SECTION_NAMES.items():
            if name not in include:
                snap.pop(key)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())
    return JSONResponse({"timestamp": stamp,
                         "version": SGLANG_VERSION, "accelerator": "SIM H100",
                         "num_accelerators": 1, "loads": [snap]})


async def metrics(request: Request) -> Response:
    return PlainTextResponse(render_metrics(_state(request)),
                             media_type="text/plain; version=0.0.4; charset=utf-8")


async def sim_stats(request: Request) -> Response:
    state = _state(request)
    extra = {
        "faults": state.config.faults.as_dict(),
        "cache": {"size_tokens": state.cache.size, "capacity_tokens": state.cache.capacity,
                  "evicted_tokens": state.cache.evicted_tokens},
        "kv_events_published": state.publisher.published if state.publisher else 0,
    }
    return JSONResponse(state.stats.snapshot(state.config.mode, len(state.jobs), extra))


async def sim_reset(request: Request) -> Response:
    _state(request).stats.reset()
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
