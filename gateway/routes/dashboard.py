"""The built-in status page at /dashboard and the JSON it polls.

    GET /dashboard        one self-contained HTML page (gateway/static/dashboard.html)
    GET /dashboard/data   servers, per-role counts, request totals, cache figures,
                          recent errors and TTFT / inter-token latency percentiles per 10 s
                          over the last minutes (gateway/observability/latency_history.py),
                          as JSON; admin role (it shows server URLs), like /admin

The page polls /dashboard/data every 2 s and derives rates from the totals of its polls of
the last 10 s. The request rate is of requests received (answered plus in flight, the
`received` total): a rate of answers over one poll read 0/s while long streams ran and none
ended. Every number on the page says what it counts ("2 of 2", "1 req · 40 tok"). The only
state the gateway keeps for it is the ring of histogram snapshots behind the latency
plots (one per 10 s, ten minutes). Every other figure is read from the pool, the admission
queue and the metric counters at request time.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.admission.slots import Admission
from gateway.observability.latency_history import LatencyHistory
from gateway.routes.state import RuntimeState
from gateway.scheduling.models import Models
from gateway.scheduling.scheduler import Scheduler
from gateway.servers.pool import ROLES, ServerPool

STATIC = Path(__file__).resolve().parent.parent / "static"
PAGE = STATIC / "dashboard.html"
INLINED = ("plots.js",)  # <script data-inline="NAME"></script> in the page becomes NAME's text
RECENT_ERRORS_SHOWN = 20
# The page is inline HTML, CSS and script that talks only to this gateway.
PAGE_HEADERS = {
    "cache-control": "no-cache",
    "content-security-policy": (
        "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'"),
    "x-content-type-options": "nosniff",
}
ERROR_FIELDS = ("time", "endpoint", "status", "type", "message", "request_id")


@dataclass(frozen=True, slots=True)
class DashboardParts:
    pool: ServerPool
    models: Models
    scheduler: Scheduler
    admission: Admission
    latency: LatencyHistory  # the ring of histogram snapshots behind the plots
    state: RuntimeState
    read_metrics: Callable[[], list]  # summed over the --workers processes, if any
    version: str
    replica_id: int


async def page(request: Request, parts: DashboardParts) -> Response:
    return Response(page_bytes(), media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)


@functools.cache
def page_bytes() -> bytes:
    """The page with its scripts inlined (the CSP allows inline scripts only), read once."""
    text = PAGE.read_text()
    for name in INLINED:
        script = (STATIC / name).read_text()
        text = text.replace(f'<script data-inline="{name}"></script>',
                            f"<script>\n{script}</script>")
    return text.encode()


async def data(request: Request, parts: DashboardParts) -> Response:
    servers = [w.snapshot() for w in parts.pool]
    roles = {role: {"total": 0, "usable": 0} for role in ROLES}
    for server in servers:
        counts = roles[server["role"]]
        counts["total"] += 1
        counts["usable"] += 1 if server["usable"] else 0
    read = parts.read_metrics()  # summed over workers, if any
    families = {f.name: f for f in read}
    prompt = _totals(_family(families, "gateway_prompt_tokens"), "server")
    cached = _totals(_family(families, "gateway_cached_tokens"), "server")
    for server in servers:
        server["prompt_tokens"] = prompt.get(server["url"], 0.0)
        server["cached_tokens"] = cached.get(server["url"], 0.0)
    body = {
        "time": time.time(),
        "gateway": _gateway(parts),
        "roles": roles,
        "servers": servers,
        "admission": {
            "active": parts.admission.active,
            "queued": parts.admission.queued,
            "limit": parts.admission.limit,
            "max_queue": parts.admission.max_queue,
        },
        "requests": _request_totals(_family(families, "gateway_requests"), parts.admission),
        "cache": {
            "prompt_tokens": sum(prompt.values()),
            "cached_tokens": sum(cached.values()),
            "hit_ratio": _ratio(sum(cached.values()), sum(prompt.values())),
        },
        "recent_errors": recent_errors(parts.state),
        "latency": parts.latency.series(read),  # TTFT and ITL percentiles per 10 s
    }
    return JSONResponse(body, headers={"cache-control": "no-store"})


def _gateway(parts: DashboardParts) -> dict:
    shutting_down = parts.state.shutting_down
    return {
        "version": parts.version,
        "replica_id": parts.replica_id,
        "prefill_policy": parts.scheduler.policies["prefill"].name,
        "decode_policy": parts.scheduler.policies["decode"].name,
        "shutting_down": shutting_down,
        "ready": parts.models.ready() and not shutting_down,
    }


def _family(families: dict, name: str) -> list:
    family = families.get(name)
    return [family] if family is not None else []


def _totals(families: Iterable, label: str) -> dict[str, float]:
    """Counter values summed by one label, read from a counter's `collect()`."""
    out: dict[str, float] = {}
    for family in families:
        for sample in family.samples:
            if sample.name.endswith("_total"):
                key = sample.labels.get(label, "")
                out[key] = out.get(key, 0.0) + sample.value
    return out


def _request_totals(families: Iterable, admission: Admission) -> dict:
    """Answers by status, and `received`: answered plus in flight (admitted or queued), the
    total the page takes its request rate from. A rate of answers alone reads 0 while long
    streams run and none ends; with --workers, `in_flight` is the answering process's."""
    by_status = _totals(families, "status")
    total = sum(by_status.values())
    server_errors = sum(v for s, v in by_status.items() if s.startswith("5"))
    client_errors = sum(v for s, v in by_status.items() if s.startswith("4"))
    in_flight = admission.active + admission.queued
    return {"total": total, "in_flight": in_flight, "received": total + in_flight,
            "errors": server_errors, "client_errors": client_errors,
            "by_status": dict(sorted(by_status.items()))}


def _ratio(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def recent_errors(state: RuntimeState) -> list[dict]:
    """The newest errors first, from the gateway's ring buffer.

    Entries are dicts with (some of) ERROR_FIELDS; anything else is shown as its text.
    """
    entries = list(state.recent_errors)[-RECENT_ERRORS_SHOWN:]
    out = []
    for entry in reversed(entries):
        if isinstance(entry, dict):
            out.append({name: _plain(entry.get(name)) for name in ERROR_FIELDS})
        else:
            out.append({**dict.fromkeys(ERROR_FIELDS), "message": str(entry)})
    return out


def _plain(value):
    """A JSON-safe scalar."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)

