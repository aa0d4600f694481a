"""Admin API (admin role, see gateway/auth.py): servers with state and load; add, remove and
drain servers at runtime; the policies' figures.

    GET    /admin/servers                      every server with health, breaker, load
    POST   /admin/servers    {url, role, bootstrap_port?}
    DELETE /admin/servers    {url}             removes at once; in-flight requests finish
    POST   /admin/servers/drain {url, timeout?} no new work; answers when it is idle
    POST   /admin/servers/undrain {url}
    GET    /admin/policies                     each role's policy, options and own figures

A server is added only once its `/server_info` answers with the role it is added as (the
probe), so an unreachable or foreign URL is refused rather than kept in the pool.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.config_servers import ConfigError, validate_url
from gateway.errors import BadRequest, GatewayError, NotFound
from gateway.routes.asgi import read_json
from gateway.workers import ROLES

MAX_DRAIN_WAIT = 3600.0


async def list_servers(request: Request) -> Response:
    gw = request.app.state.gateway
    servers = []
    for worker in gw.pool:
        snapshot = worker.snapshot()
        snapshot["learned_latency"] = gw.dispatcher.model.snapshot(worker.url)
        servers.append(snapshot)
    return JSONResponse({"servers": servers, "pairs": gw.scheduler.pairs.snapshot(),
                         "panic_picks": dict(gw.scheduler.panics)})


async def list_policies(request: Request) -> Response:
    gw = request.app.state.gateway
    body = {role: {"name": policy.name, "options": dataclasses.asdict(policy.options),
                   "stats": policy.stats()}
            for role, policy in gw.scheduler.policies.items()}
    return JSONResponse(body)


async def add_server(request: Request) -> Response:
    gw = request.app.state.gateway
    body = await read_json(request)
    role = body.get("role")
    if role not in ROLES:
        raise BadRequest("'role' must be 'prefill' or 'decode'")
    try:
        url = validate_url(str(body.get("url", "")))
    except ConfigError as exc:
        raise BadRequest(str(exc)) from None
    port = body.get("bootstrap_port")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int)
                             or not 0 < port < 65536):
        raise BadRequest("'bootstrap_port' must be a port number")
    if gw.pool.get(url) is not None:
        raise GatewayError(f"{url} is already registered", status=409)
    worker = await gw.register(url, role, port, require_probe=True)
    return JSONResponse({"server": worker.snapshot()}, status_code=201)


def _worker(gw, body: dict):
    url = body.get("url")
    if not isinstance(url, str):
        raise BadRequest("'url' must be a server URL")
    worker = gw.pool.get(url.rstrip("/"))
    if worker is None:
        raise NotFound(f"no server {url!r}")
    return worker


async def remove_server(request: Request) -> Response:
    gw = request.app.state.gateway
    worker = _worker(gw, await read_json(request))
    gw.unregister(worker.url)
    return JSONResponse({"removed": worker.snapshot()})


async def drain_server(request: Request) -> Response:
    gw = request.app.state.gateway
    body = await read_json(request)
    worker = _worker(gw, body)
    timeout = body.get("timeout", 60)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
            or not 0 <= timeout <= MAX_DRAIN_WAIT:
        raise BadRequest(f"'timeout' must be a number of seconds in 0..{MAX_DRAIN_WAIT:g}")
    worker.draining = True
    deadline = time.monotonic() + timeout
    while worker.in_flight > 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return JSONResponse({"drained": worker.in_flight == 0, "server": worker.snapshot()},
                        status_code=200 if worker.in_flight == 0 else 202)


async def undrain_server(request: Request) -> Response:
    gw = request.app.state.gateway
    worker = _worker(gw, await read_json(request))
    worker.draining = False
    return JSONResponse({"server": worker.snapshot()})
