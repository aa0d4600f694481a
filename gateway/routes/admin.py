"""Admin API: list servers with state and load; add, remove and drain servers at runtime.

    GET    /admin/servers                      every server with health, breaker, load
    POST   /admin/servers    {url, role, bootstrap_port?}
    DELETE /admin/servers    {url}             removes at once; in-flight requests finish
    POST   /admin/servers/drain {url, timeout?} no new work; answers when it is idle
    POST   /admin/servers/undrain {url}
    GET    /admin/policies                     each role's policy, options and own figures
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.config_servers import ConfigError, validate_url
from gateway.errors import BadRequest, GatewayError, NotFound
from gateway.routes.errors import json_error


async def _json(request: Request) -> dict:
    try:
        body = orjson.loads(await request.body() or b"{}")
    except orjson.JSONDecodeError:
        raise BadRequest("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def _guard(request: Request):
    gw = request.app.state.gateway
    gw.admin_keys.check(request.headers.get("authorization"), request.headers.get("x-api-key"))
    return gw


async def list_servers(request: Request) -> Response:
    try:
        gw = _guard(request)
    except GatewayError as err:
        return json_error(err)
    return JSONResponse({"servers": [w.snapshot() for w in gw.pool]})


async def list_policies(request: Request) -> Response:
    try:
        gw = _guard(request)
    except GatewayError as err:
        return json_error(err)
    body = {role: {"name": policy.name, "options": dataclasses.asdict(policy.options),
                   "stats": policy.stats()}
            for role, policy in gw.scheduler.policies.items()}
    return JSONResponse(body)


async def add_server(request: Request) -> Response:
    try:
        gw = _guard(request)
        body = await _json(request)
        role = body.get("role")
        if role not in ("prefill", "decode"):
            raise BadRequest("'role' must be 'prefill' or 'decode'")
        try:
            url = validate_url(str(body.get("url", "")))
        except ConfigError as exc:
            raise BadRequest(str(exc)) from None
        port = body.get("bootstrap_port")
        if port is not None and (not isinstance(port, int) or not 0 < port < 65536):
            raise BadRequest("'bootstrap_port' must be a port number")
        if gw.pool.get(url) is not None:
            raise GatewayError(f"{url} is already registered", status=409)
        worker = await gw.register(url, role, port)
    except GatewayError as err:
        return json_error(err)
    return JSONResponse({"server": worker.snapshot()}, status_code=201)


async def remove_server(request: Request) -> Response:
    try:
        gw = _guard(request)
        url = str((await _json(request)).get("url", "")).rstrip("/")
        worker = gw.unregister(url)
        if worker is None:
            raise NotFound(f"no server {url!r}")
    except GatewayError as err:
        return json_error(err)
    return JSONResponse({"removed": worker.snapshot()})


async def drain_server(request: Request) -> Response:
    try:
        gw = _guard(request)
        body = await _json(request)
        worker = gw.pool.get(str(body.get("url", "")).rstrip("/"))
        if worker is None:
            raise NotFound(f"no server {body.get('url')!r}")
        timeout = body.get("timeout", 60)
        if not isinstance(timeout, (int, float)) or timeout < 0:
            raise BadRequest("'timeout' must be a number of seconds")
    except GatewayError as err:
        return json_error(err)
    worker.draining = True
    deadline = time.monotonic() + timeout
    while worker.in_flight > 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return JSONResponse({"drained": worker.in_flight == 0, "server": worker.snapshot()},
                        status_code=200 if worker.in_flight == 0 else 202)


async def undrain_server(request: Request) -> Response:
    try:
        gw = _guard(request)
        body = await _json(request)
        worker = gw.pool.get(str(body.get("url", "")).rstrip("/"))
        if worker is None:
            raise NotFound(f"no server {body.get('url')!r}")
    except GatewayError as err:
        return json_error(err)
    worker.draining = False
    return JSONResponse({"server": worker.snapshot()})
