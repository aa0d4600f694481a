"""POST /admin/servers/role (admin role): switch a server between prefill and decode.

    {"url": "http://10.0.0.5:30000", "role": "decode", "deadline": 60,
     "decode_cuda_graph_memory_gb": 1.5?, "decode_cuda_graph_bs": [1, 2, 4]?}

200 with the re-registered server; 409 when refused (nothing changed: another switch runs,
a role would be left empty, still busy at the deadline, SGLang said no), 502 when the server
broke midway (taken out). The procedure is gateway/servers/role_switch.py. Every outcome is
counted (`gateway_role_switches_total`), logged, written to the access log (endpoint
`/admin/servers/role`, the server in the column of the role asked for), and a refusal or
failure is kept with the recent errors the status page lists. A switch cut off by the end of
`--shutdown-grace` (its task cancelled) is counted (`cancelled`), logged and recorded the same
way, answered with a JSON 503 if the connection still takes it, and stays cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from gateway.errors import GatewayError, ServiceUnavailable, error_bytes
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
CUT_OFF = "the gateway is shutting down and the role switch outlived --shutdown-grace: {url} "
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
        refuse_all=DISCOVERY if c.prefill_selector or c.decode_selector else None,
        shutting_down=lambda: gw.state.shutting_down))
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
    except asyncio.CancelledError as cancelled:
        return _cut_off(parts, ask, started, request_id, cancelled)
    parts.counted.labels("switched").inc()
    log.warning("role switch %s: %s is now a %s server (drained and switched in %.3fs)",
                request_id, ask.url, ask.new_role, body["waited_s"])
    _access(parts, ask, 200, started, request_id)
    return JSONResponse({**body, "request_id": request_id})


def _cut_off(parts: RoleSwitchParts, ask: SwitchAsk, started: float, request_id: str,
             cancelled: asyncio.CancelledError) -> Response:
    """Count, log and record a switch the shutdown cut off; the answer that sends its 503
    and then raises `cancelled` (before: uvicorn's plain-text 500, and no record)."""
    err = ServiceUnavailable(CUT_OFF.format(url=ask.url) + _left(parts, ask.url),
                             code="role_switch_cancelled", headers={"retry-after": "1"})
    parts.counted.labels("cancelled").inc()
    log.warning("role switch %s of %s to %s: cancelled (%s)", request_id, ask.url,
                ask.new_role, err.detail)
    parts.note_error(err, PATH, request_id)
    _access(parts, ask, err.status, started, request_id)
    return CutOff(err, request_id, cancelled)


def _left(parts: RoleSwitchParts, url: str) -> str:
    """How the switcher left the server (role_switch.py: put back unless the switch itself
    had been sent, then taken out), for the operator reading the 503."""
    server = parts.switcher.parts.pool.get(url)
    if server is None:
        return "is out of the pool: add it again"
    if server.misconfigured:
        return "is taken out (its state is unknown): restart it, then remove and add it again"
    return f"stays a {server.role} server, as it was"


class CutOff(Response):
    """The JSON 503 of a switch cut off by the shutdown, then its cancellation: a handler
    cannot both answer and raise, so the answer raises once sent (the cancellation must
    reach the task uvicorn cancelled)."""

    def __init__(self, err: GatewayError, request_id: str,
                 cancelled: asyncio.CancelledError) -> None:
        super().__init__(error_bytes(err, request_id, operator=True), err.status,
                         headers=err.headers, media_type="application/json")
        self.cancelled = cancelled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except Exception as exc:  # noqa: BLE001 - the connection may be gone: still cancelled
            log.debug("the 503 of a cut-off role switch was not sent: %r", exc)
        raise self.cancelled


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
