"""Info, health and cluster-wide operations: models, server info, flush, abort."""

from __future__ import annotations

import asyncio

import httpx
import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.errors import BadRequest, GatewayError, ServiceUnavailable
from gateway.request import parse_request
from gateway.routes.errors import json_error
from gateway.upstream import upstream_message

HEALTH_PROBE = b'{"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}'


async def health(request: Request) -> Response:
    """The gateway process is alive (liveness)."""
    return Response(status_code=200)


async def readiness(request: Request) -> Response:
    gw = request.app.state.gateway
    body = {
        "ready": gw.pool.ready() and not gw.shutting_down,
        "prefill_usable": len(gw.pool.usable("prefill")),
        "decode_usable": len(gw.pool.usable("decode")),
        "shutting_down": gw.shutting_down,
    }
    return JSONResponse(body, status_code=200 if body["ready"] else 503)


async def health_generate(request: Request) -> Response:
    """A real one-token PD request through a pair."""
    gw = request.app.state.gateway
    view = parse_request("generate", HEALTH_PROBE)
    try:
        async with asyncio.timeout(gw.config.health_timeout * 4):
            answer = await gw.proxy.handle(view, "health-generate")
            if answer.close is not None:
                await answer.close()
    except GatewayError as err:
        return json_error(err)
    except TimeoutError:
        return json_error(ServiceUnavailable("health generation timed out"))
    return Response(status_code=200)


async def _get_from_any(request: Request, path: str) -> Response:
    """Relay a GET to the first usable server that answers (decode first: it serves
    the client-visible answer)."""
    gw = request.app.state.gateway
    workers = gw.pool.usable("decode") + gw.pool.usable("prefill")
    workers = workers or list(gw.pool)
    last = "no servers registered"
    for worker in workers:
        try:
            response = await gw.client.get(worker.url + path, timeout=gw.config.probe_timeout)
        except httpx.HTTPError as exc:
            last = f"{worker.url}: {type(exc).__name__}"
            continue
        if response.status_code == 200:
            return Response(response.content, media_type="application/json")
        last = f"{worker.url} answered {response.status_code}: {upstream_message(response.content)}"
    return json_error(ServiceUnavailable(f"no server could answer {path}: {last}"))


async def models(request: Request) -> Response:
    return await _get_from_any(request, "/v1/models")


async def model_info(request: Request) -> Response:
    return await _get_from_any(request, "/model_info")


async def server_info(request: Request) -> Response:
    """Each server's own info, grouped by role, plus the gateway's view."""
    gw = request.app.state.gateway

    async def one(worker):
        try:
            r = await gw.client.get(worker.url + "/server_info", timeout=gw.config.probe_timeout)
            return worker, (r.json() if r.status_code == 200 else {"error": r.status_code})
        except (httpx.HTTPError, ValueError) as exc:
            return worker, {"error": type(exc).__name__}

    results = await asyncio.gather(*(one(w) for w in gw.pool))
    body: dict = {"prefill": [], "decode": [], "internal_states": []}
    for worker, info in results:
        body[worker.role].append({"url": worker.url, **info})
        if worker.role == "decode" and isinstance(info.get("internal_states"), list):
            body["internal_states"].extend(info["internal_states"])
    body["gateway"] = {
        "version": gw.version,
        "replica_id": gw.rooms.replica_id,
        "prefill_policy": gw.scheduler.policies["prefill"].name,
        "decode_policy": gw.scheduler.policies["decode"].name,
    }
    return JSONResponse(body)


async def _post_all(gw, path: str, payload: bytes) -> tuple[bool, list[dict]]:
    async def one(worker):
        try:
            r = await gw.client.post(worker.url + path, content=payload,
                                     headers={"content-type": "application/json"},
                                     timeout=gw.config.probe_timeout)
            return {"url": worker.url, "role": worker.role, "status": r.status_code,
                    "ok": r.status_code < 300, "message": upstream_message(r.content)}
        except httpx.HTTPError as exc:
            return {"url": worker.url, "role": worker.role, "status": None, "ok": False,
                    "message": f"{type(exc).__name__}: {exc}"}

    results = await asyncio.gather(*(one(w) for w in gw.pool))
    return all(r["ok"] for r in results), list(results)


async def flush_cache(request: Request) -> Response:
    gw = request.app.state.gateway
    gw.admin_keys.check(request.headers.get("authorization"), request.headers.get("x-api-key"))
    ok, results = await _post_all(gw, "/flush_cache", b"{}")
    return JSONResponse({"success": ok, "results": results}, status_code=200 if ok else 502)


async def abort_request(request: Request) -> Response:
    gw = request.app.state.gateway
    gw.inference_keys.check(request.headers.get("authorization"), request.headers.get("x-api-key"))
    raw = await request.body()
    try:
        body = orjson.loads(raw or b"{}")
    except orjson.JSONDecodeError:
        return json_error(BadRequest("request body is not valid JSON"))
    if not isinstance(body, dict) or not isinstance(body.get("rid"), (str, type(None))):
        return json_error(BadRequest("'rid' must be a string"))
    ok, results = await _post_all(gw, "/abort_request", orjson.dumps(body))
    return JSONResponse({"success": ok, "results": results}, status_code=200 if ok else 502)


async def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.gateway.registry),
                    media_type=CONTENT_TYPE_LATEST)

