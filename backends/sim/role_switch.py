"""POST /pd_role_switch: flip an idle simulated server between prefill and decode.

Mirrors SGLang 0.5.23's runtime role switch, each rule citing its function:

* the route (entrypoints/http_server.py `pd_role_switch`): 200 with the output's fields when
  `success`, else 400 with them; the body is `PdRoleSwitchReqInput` (managers/io_struct.py):
  `new_role`, `decode_cuda_graph_bs`, `decode_cuda_graph_memory_gb`, `prepare_only`.
* the tokenizer's side (managers/tokenizer_control_mixin.py `pd_role_switch`): without
  `--enable-pd-role-switch` it refuses at once (safe to restore); with several DP ranks every
  rank is asked `prepare_only` first and only then switched; messages of the failing ranks are
  joined by "; "; success and safe_to_restore are the AND over the ranks.
* each rank's side (disaggregation/role_switch.py `handle_pd_role_switch`, `_reject_reason`):
  the preconditions in SGLang's order, then "already in target role", the idle requirement
  (`Scheduler.is_fully_idle`: nothing queued, running, prefilled and sending KV, or awaiting
  KV), the decode CUDA graph headroom (`get_available_gpu_memory`, the `gpu_free_gb` fault
  knob here), `prepare_only` -> "ready", then the flip; a flip that raises leaves the instance
  unhealthy (no rollback), which the `role_switch_fail` fault knob forces.
* the flip (`teardown_disaggregation`, `_release_prefix_cache_for_role_switch`): the old
  role's KV manager goes (prefill rooms and KV channels; a decode's bootstrap links), the
  prefix cache is cleared, the new role's structures are built. The bootstrap server is not
  touched: with the flag it runs on every PD instance from launch (managers/disagg_service.py
  `start_disagg_service`), so one flipped to prefill already serves its bootstrap port.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from backends.sim.config import DEFAULT_GRAPH_BS
from backends.sim.kvclient import BootstrapClient
from backends.sim.rooms import RoomRegistry
from backends.sim.state import SimState

ROLES = ("prefill", "decode")
SUPPORTING_BACKENDS = ("mooncake", "mori")  # KVManager.supports_role_switch (their conn.py)


@dataclasses.dataclass
class Outcome:
    """`PdRoleSwitchReqOutput` (managers/io_struct.py)."""

    success: bool
    message: str
    old_role: str
    new_role: str
    safe_to_restore: bool = False


def _reject_reason(state: SimState, new_role: str) -> tuple[str, bool] | None:
    """mirrors role_switch._reject_reason: the first failing precondition, its safety."""
    cfg = state.config
    checks = (
        (not cfg.enable_pd_role_switch, True,
         "--enable-pd-role-switch is not set on this instance"),
        (state.pd_role_switch_unhealthy, False,
         "instance is unhealthy after a failed role switch; restart required"),
        (state.pd_role_switch_in_progress, False, "another role switch is already in progress"),
        (new_role not in ROLES, True, f"invalid new_role={new_role!r}"),
        (cfg.mode == "null", True, "instance is not running in PD disaggregation mode"),
        (cfg.transfer_backend not in SUPPORTING_BACKENDS, True,
         f"transfer backend {cfg.transfer_backend!r} does not support runtime role switch"),
    )
    return next(((msg, safe) for failed, safe, msg in checks if failed), None)


def fully_idle(state: SimState) -> bool:
    """mirrors Scheduler.is_fully_idle: no rank holds a request in any queue (waiting,
    prefilling, running, prefilled and sending its KV), and no item awaits its KV."""
    engines = [rank.engine for rank in state.ranks]
    return not state.jobs and all(
        not (e.waiting or e.prefilling or e.decoding or e.inflight) for e in engines)


def _check(state: SimState, body: dict[str, Any]) -> Outcome:
    """mirrors handle_pd_role_switch up to the flip: the same answer for every rank (the
    sim's ranks share one role and are idle together)."""
    old, new = state.config.mode, str(body.get("new_role") or "").lower()

    def fail(message: str, safe: bool = False) -> Outcome:
        return Outcome(False, message, old, new, safe)

    rejection = _reject_reason(state, new)
    if rejection is not None:
        return fail(*rejection)
    if new == old:
        return Outcome(True, "already in target role", old, new)
    if not fully_idle(state):
        return fail("instance is not idle; drain all requests before switching", True)
    need_gb = body.get("decode_cuda_graph_memory_gb")
    if new == "decode" and not state.decode_graph_bs:  # will_capture_graphs
        if need_gb is None:
            return fail("decode_cuda_graph_memory_gb is required before capturing decode "
                        "graphs", True)
        if need_gb < 0:
            return fail("decode_cuda_graph_memory_gb must be non-negative", True)
        free = state.config.faults.gpu_free_gb
        if free < need_gb:
            return fail("insufficient decode CUDA graph headroom: "
                        f"required={need_gb:.3f} GB, available={free:.3f} GB", True)
    return Outcome(True, "ready", old, new, True)


def _flip(state: SimState, new: str, graph_bs: list[int] | None) -> None:
    """mirrors teardown_disaggregation + init_disaggregation: one atomic step."""
    if state.config.faults.role_switch_fail:
        raise RuntimeError("simulated failure while rebuilding the disaggregation queues "
                           "(role_switch_fail fault)")
    config = dataclasses.replace(state.config, mode=new)
    state.config = config
    state.telemetry.config = config
    for rank in state.ranks:
        rank.engine.config = config
        rank.cache.clear()  # _release_prefix_cache_for_role_switch
        rank.decode_rooms.clear()
        ttl = 2 * max(config.bootstrap_timeout, config.waiting_timeout) + 60  # as at launch
        rank.registry = RoomRegistry(open_ttl=ttl, dp_rank=rank.index) if new == "prefill" \
            else None
    if state.bootstrap is not None:
        state.bootstrap.config = config
        state.bootstrap.registries = [r.registry for r in state.ranks if r.registry]
        state.bootstrap.drop_kv_channels()  # the old prefill KV manager's teardown
    if new == "prefill" and state.client is not None:
        state.client.close()  # CommonKVReceiver.close_all_sockets
        state.client = None
    if new == "decode":
        state.client = BootstrapClient(config)
        # ensure_decode_cuda_graphs: captured once, the asked list or the configured one
        state.decode_graph_bs = state.decode_graph_bs or list(graph_bs or DEFAULT_GRAPH_BS)


def switch(state: SimState, body: dict[str, Any]) -> Outcome:
    """The tokenizer's and the scheduler's parts together (tokenizer_control_mixin.py
    pd_role_switch over handle_pd_role_switch)."""
    cfg = state.config
    if not cfg.enable_pd_role_switch:
        return Outcome(False, "--enable-pd-role-switch is not set on this server", cfg.mode,
                       str(body.get("new_role") or ""), True)
    ranks = max(len(state.ranks), 1)
    checked = [_check(state, body) for _ in range(ranks)]
    if not all(o.success for o in checked):
        return _merged(checked, body)
    if body.get("prepare_only") or checked[0].message == "already in target role":
        return _merged(checked, body)
    old, new = cfg.mode, checked[0].new_role
    state.pd_role_switch_in_progress = True
    try:
        _flip(state, new, body.get("decode_cuda_graph_bs"))
    except Exception as exc:  # noqa: BLE001 - mirrors the catch-all around the rebuild
        state.pd_role_switch_unhealthy = True
        return Outcome(False, f"role switch failed; instance unhealthy, restart required: "
                              f"{exc}", old, new, False)
    finally:
        state.pd_role_switch_in_progress = False
    state.role_switches += 1
    return Outcome(True, "ok", old, new)


def _merged(results: list[Outcome], body: dict[str, Any]) -> Outcome:
    ok = all(o.success for o in results)
    message = results[0].message if ok else "; ".join(o.message for o in results
                                                       if not o.success)
    return Outcome(ok, message, results[0].old_role, str(body.get("new_role") or ""),
                   all(o.safe_to_restore for o in results))


def _valid(body: Any) -> str | None:
    """The pydantic/msgspec validation of PdRoleSwitchReqInput, reduced to what matters."""
    if not isinstance(body, dict):
        return "body must be a JSON object"
    if body.get("new_role", "") not in ("prefill", "decode", ""):
        return "new_role must be one of 'prefill', 'decode', ''"
    gb = body.get("decode_cuda_graph_memory_gb")
    if gb is not None and (isinstance(gb, bool) or not isinstance(gb, (int, float))):
        return "decode_cuda_graph_memory_gb must be a number"
    bs = body.get("decode_cuda_graph_bs")
    if bs is not None and not (isinstance(bs, list) and all(isinstance(b, int) for b in bs)):
        return "decode_cuda_graph_bs must be a list of integers"
    return None


async def pd_role_switch(request: Request) -> Response:
    """The route: 200 on success, 400 otherwise, the output's fields as the body."""
    state: SimState = request.app.state.sim
    try:
        body = orjson.loads(await request.body() or b"{}")
    except orjson.JSONDecodeError:
        body = None
    problem = _valid(body)
    if problem is not None:
        return JSONResponse({"object": "error", "message": problem, "type": "BadRequest",
                             "param": None, "code": 400}, status_code=400)
    outcome = switch(state, body)
    return JSONResponse(dataclasses.asdict(outcome), status_code=200 if outcome.success else 400)
