"""Health, readiness, metrics and server info.

What each costs the servers, and who may ask (the role is in app.ROUTES):
* `/health`, `/readiness`, `/metrics`: answered from the gateway's own state, open to probes
  and scrapers.
* `/health_generate`: a real one-token PD generation, open to probes, but through a cache:
  at most one generation per `--info-cache-ttl` seconds however many callers ask.
* `/server_info` (and `/v1/models`, `/model_info` in routes/models.py): inference callers;
  cached the same way, so a caller cannot make the gateway fan out to every server per call.
  Secrets in the servers' own arguments (API keys, tokens) are redacted.
"""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.errors import GatewayError, ServiceUnavailable
from gateway.redact import redact
from gateway.request import parse_request
from gateway.upstream.client import upstream_message

HEALTH_PROBE = b'{"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}'


async def health(request: Request) -> Response:
    """The gateway process is alive (liveness)."""
    return Response(status_code=200)


async def readiness(request: Request) -> Response:
    """Ready while some model has a usable prefill and decode server (one model down must
    not take the others' traffic away with the gateway)."""
    gw = request.app.state.gateway
    body = {
        "ready": gw.models.ready() and not gw.shutting_down,
        "prefill_usable": len(gw.pool.usable("prefill")),
        "decode_usable": len(gw.pool.usable("decode")),
        "shutting_down": gw.shutting_down,
    }
    if not gw.models.open:
        body["models"] = {m.name: bool(m.usable("prefill") and m.usable("decode"))
                          for m in gw.models.known.values()}
    return JSONResponse(body, status_code=200 if body["ready"] else 503)


async def health_generate(request: Request) -> Response:
    status, body = await request.app.state.gateway.info_cache("health_generate").get()
    return Response(body, status_code=status, media_type="application/json")


async def generate_probe(gw) -> tuple[int, bytes]:
    """One real one-token PD request through a pair of every model (the cached computation);
    the first failure is the answer, naming its model when there are several."""
    listed = gw.models.listed()
    if gw.models.open or not listed:
        return await _generate_once(gw, parse_request("generate", HEALTH_PROBE))
    results = await asyncio.gather(*(
        _generate_once(gw, dataclasses.replace(parse_request("generate", HEALTH_PROBE),
                                               model=model.name)) for model in listed))
    for model, (status, body) in zip(listed, results, strict=True):
        if status != 200:
            error = orjson.loads(body)
            error["error"]["message"] = f"model {model.name}: {error['error']['message']}"
            return status, orjson.dumps(error)
    return 200, b'{"healthy": true}'


async def _generate_once(gw, view) -> tuple[int, bytes]:
    try:
        async with asyncio.timeout(gw.config.health_timeout * 4):
            answer = await gw.proxy.handle(view, gw.tracked_probe())
            if answer.close is not None:
                await answer.close()
    except GatewayError as err:
        return err.status, orjson.dumps(err.body())
    except TimeoutError:
        err = ServiceUnavailable("health generation timed out")
        return err.status, orjson.dumps(err.body())
    return 200, b'{"healthy": true}'


async def get_from_any(gw, path: str, model=None) -> tuple[int, bytes]:
    """A GET relayed to the first usable server (of `model`, else of any) that answers
    (decode first: it serves the client-visible answer)."""
    if model is None:
        servers = gw.pool.usable("decode") + gw.pool.usable("prefill") or list(gw.pool)
    else:
        servers = (model.usable("decode") + model.usable("prefill")
                   or model.servers["decode"] + model.servers["prefill"])
    last = "no servers registered"
    for server in servers:
        try:
            response = await gw.client.get(server.url + path, timeout=gw.config.probe_timeout)
        except httpx.HTTPError as exc:
            last = f"{server.url}: {type(exc).__name__}"
            continue
        if response.status_code == 200:
            return 200, orjson.dumps(redact(response.json()))
        last = f"{server.url} answered {response.status_code}: {upstream_message(response.content)}"
    err = ServiceUnavailable(f"no server could answer {path}: {last}")
    return err.status, orjson.dumps(err.body())


async def server_info(request: Request) -> Response:
    status, body = await request.app.state.gateway.info_cache("server_info").get()
    return Response(body, status_code=status, media_type="application/json")


async def collect_server_info(gw) -> tuple[int, bytes]:
    """Each server's own info, grouped by role, plus the gateway's view."""

    async def one(server):
        try:
            r = await gw.client.get(server.url + "/server_info", timeout=gw.config.probe_timeout)
            return server, (redact(r.json()) if r.status_code == 200 else {"error": r.status_code})
        except (httpx.HTTPError, ValueError) as exc:
            return server, {"error": type(exc).__name__}

    results = await asyncio.gather(*(one(w) for w in gw.pool))
    body: dict = {"prefill": [], "decode": [], "internal_states": []}
    for server, info in results:
        if not isinstance(info, dict):
            info = {"error": "not a JSON object"}
        body[server.role].append({"url": server.url, **info})
        if server.role == "decode" and isinstance(info.get("internal_states"), list):
            body["internal_states"].extend(info["internal_states"])
    body["gateway"] = gw.describe()
    return 200, orjson.dumps(body)


async def metrics(request: Request) -> Response:
    gw = request.app.state.gateway
    gw.metrics.flush()
    return Response(generate_latest(gw.registry),
                    media_type=CONTENT_TYPE_LATEST)
