"""POST /admin/servers/role (admin role): switch a server between prefill and decode.

    {"url": "http://10.0.0.5:30000", "role": "decode", "deadline": 60,
     "decode_cuda_graph_memory_gb": 1.5?, "decode_cuda_graph_bs": [1, 2, 4]?}

200 with the re-registered server; 409 when refused (nothing changed: another switch runs,
a role would be left empty, still busy at the deadline, SGLang said no), 502 when the server
broke midway (taken out). The procedure is gateway/servers/role_switch.py. Every outcome is
counted (`gateway_role_switches_total`), logged, written to the access log (endpoint
`/admin/servers/role`, the server in the column of the role asked for), and a refusal or
failure is kept with the recent errors the status page lists.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.errors import GatewayError
from gateway.observability.usage import RequestUsage, Usage
from gateway.routes.asgi import read_json
from gateway.servers.role_switch import RoleSwitcher, SwitchAsk, SwitchParts
from gateway.servers.switch_lock import SwitchLock

if TYPE_CHECKING:
    from gateway.runtime import Gateway

log = logging.getLogger("gateway.role_switch")

PATH = "/admin/servers/role"
# error code -> the outcome label of gateway_role_switches_total (others are not counted)
OUTCOMES = {"role_switch_in_progress": "conflict", "role_empty": "conflict",
            "role_switch_unavailable": "conflict", "role_switch_busy": "busy",
            "role_switch_refused": "refused", "role_switch_failed": "failed",
            "role_switch_unverified": "failed"}
DISCOVERY = ("servers come from Kubernetes discovery, where a pod's role is its selector's: "
             "switching one here would contradict its labels (docs/ROLE_SWITCH.md)")


@dataclass(frozen=True, slots=True)
class RoleSwitchParts:
    switcher: RoleSwitcher
    counted: Any  # gateway_role_switches (labels: outcome)
    note_error: Callable[[GatewayError, str, str], None]
    usage: Usage
    write_access: Callable[[RequestUsage], None] | None


def parts_of(gw: Gateway) -> RoleSwitchParts:
    """Built once with the route table; the lock file sits beside the shared block's."""
    c = gw.config
    lock = SwitchLock(gw.shared.lock_path + ".role-switch" if gw.shared is not None else None)
    switcher = RoleSwitcher(SwitchParts(
        gw.pool, gw.client, gw.register, gw.unregister, gw.siblings.admin_change,
        c.probe_timeout, lock,
        refuse_all=DISCOVERY if c.prefill_selector or c.decode_selector else None))
    return RoleSwitchParts(switcher, gw.metrics.role_switches, gw.state.note_error, gw.usage,
                           gw.access_log.write if gw.access_log is not None else None)


async def switch_role(request: Request, parts: RoleSwitchParts) -> Response:
    ask = SwitchAsk.parse(await read_json(request))
    request_id = "switch-" + secrets.token_hex(12)
    started = time.perf_counter()
    log.info("role switch %s: %s -> %s (deadline %gs)", request_id, ask.url, ask.new_role,
             ask.deadline)
    try:
        body = await parts.switcher.switch(ask)
    except GatewayError as err:
        outcome = OUTCOMES.get(err.code or "")
        if outcome is not None:
            parts.counted.labels(outcome).inc()
        log.warning("role switch %s of %s to %s: %s (%s)", request_id, ask.url, ask.new_role,
                    outcome or err.status, err.detail)
        parts.note_error(err, PATH, request_id)
        _access(parts, ask, err.status, started, request_id)
        raise
    parts.counted.labels("switched").inc()
    log.warning("role switch %s: %s is now a %s server (drained and switched in %.3fs)",
                request_id, ask.url, ask.new_role, body["waited_s"])
    _access(parts, ask, 200, started, request_id)
    return JSONResponse({**body, "request_id": request_id})


def _access(parts: RoleSwitchParts, ask: SwitchAsk, status: int, started: float,
            request_id: str) -> None:
    """One access-log line, as a request's: the server in the column of the role asked."""
    if parts.write_access is None:
        return
    record = RequestUsage(parts.usage, PATH, request_id, started)
    record.status = status
    record.duration = time.perf_counter() - started
    if ask.new_role == "prefill":
        record.prefill = ask.url
    else:
        record.decode = ask.url
    parts.write_access(record)
