"""Health, readiness, metrics and server info.

What each costs the servers, and who may ask (the role is in app.ROUTES):
* `/health`, `/readiness`, `/metrics`: answered from the gateway's own state, open to probes
  and scrapers. A `/metrics` page is shared by every scrape for `METRICS_COST_RATIO` (20)
  times what it took to render, at most `METRICS_TTL` (0.25 s; single flight,
  routes/info_cache.py): rendering takes at most 1/21 of the event loop however often it is
  scraped (rendered for each scrape, two tight scrape loops cut the requests served by three
  quarters), and a cheap page stays fresh for probes and tests that poll a gauge (measured
  under load: about 3 ms to render, kept 60 ms; with `--workers 2`, about 30 ms, kept 0.25 s).
  Prometheus scrapes every 15 s or more: a page a quarter second old costs it nothing.
* `/health_generate`: a real one-token PD generation, open to probes, but through a cache:
  at most one generation per `--info-cache-ttl` seconds however many callers ask.
* `/server_info` (and `/v1/models`, `/model_info` in routes/models.py): inference callers;
  cached the same way, so a caller cannot make the gateway fan out to every server per call.
  Secrets in the servers' own arguments (API keys, tokens) are redacted, and for a caller
  without the admin role the servers' addresses too (URLs, hosts, ports).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx
import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.dispatch.attempt import Answer
from gateway.errors import GatewayError, ServiceUnavailable
from gateway.observability.metrics import Metrics
from gateway.redact import redact
from gateway.request import RequestView, parse_request
from gateway.routes.fleet import Fleet
from gateway.routes.state import RuntimeState

METRICS_TTL = 0.25  # seconds a rendered /metrics page is reused, at most (tests and probes
# read a gauge right after an action: a page a second old misled the DP e2e test)
METRICS_COST_RATIO = 20.0  # ... and at most this many times what it took to render
HEALTH_PROBE = b'{"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}'


@dataclass(frozen=True, slots=True)
class InfoParts:
    """What these routes read; `generate` runs one of the gateway's own requests (a method
    of the gateway, called only once it serves)."""

    fleet: Fleet
    state: RuntimeState
    metrics: Metrics
    generate: Callable[[RequestView], Awaitable[Answer]]
    describe: Callable[[], dict]
    health_timeout: float


async def health(request: Request, parts: InfoParts) -> Response:
    """The gateway process is alive (liveness)."""
    return Response(status_code=200)


async def readiness(request: Request, parts: InfoParts) -> Response:
    """Ready while some model has a usable prefill and decode server (one model down must
    not take the others' traffic away with the gateway)."""
    pool, models, state = parts.fleet.pool, parts.fleet.models, parts.state
    body = {
        "ready": models.ready() and not state.shutting_down,
        "prefill_usable": len(pool.usable("prefill")),
        "decode_usable": len(pool.usable("decode")),
        "shutting_down": state.shutting_down,
    }
    if not models.open:
        body["models"] = {m.name: bool(m.usable("prefill") and m.usable("decode"))
                          for m in models.known.values()}
    return JSONResponse(body, status_code=200 if body["ready"] else 503)


async def health_generate(request: Request, parts: InfoParts) -> Response:
    cache = parts.fleet.caches.get("health_generate", lambda: generate_probe(parts))
    status, body = await cache.get()
    return Response(body, status_code=status, media_type="application/json")


async def generate_probe(parts: InfoParts) -> tuple[int, bytes]:
    """One real one-token PD request through a pair of every model (the cached computation);
    the first failure is the answer, naming its model when there are several."""
    models = parts.fleet.models
    listed = models.listed()
    if models.open or not listed:
        return await _generate_once(parts, parse_request("generate", HEALTH_PROBE))
    results = await asyncio.gather(*(
        _generate_once(parts, dataclasses.replace(parse_request("generate", HEALTH_PROBE),
                                                  model=model.name)) for model in listed))
    for model, (status, body) in zip(listed, results, strict=True):
        if status != 200:
            error = orjson.loads(body)
            error["error"]["message"] = f"model {model.name}: {error['error']['message']}"
            return status, orjson.dumps(error)
    return 200, b'{"healthy": true}'


async def _generate_once(parts: InfoParts, view: RequestView) -> tuple[int, bytes]:
    try:
        async with asyncio.timeout(parts.health_timeout * 4):
            answer = await parts.generate(view)
            if answer.close is not None:
                await answer.close()
    except GatewayError as err:
        return err.status, orjson.dumps(err.body())
    except TimeoutError:
        err = ServiceUnavailable("health generation timed out")
        return err.status, orjson.dumps(err.body())
    return 200, b'{"healthy": true}'


async def server_info(request: Request, parts: InfoParts) -> Response:
    """An admin's view names each server and its addresses; an inference caller's has the
    same entries without them (what a benchmark reads: modes, sizes, internal states)."""
    caches = parts.fleet.caches
    full = caches.get("server_info", lambda: collect_server_info(parts))
    shown = full if request.state.caller.is_admin else caches.get(
        "server_info:caller", lambda: _without_addresses(full.get()))
    status, body = await shown.get()
    return Response(body, status_code=status, media_type="application/json")


async def _without_addresses(answer: Awaitable[tuple[int, bytes]]) -> tuple[int, bytes]:
    status, body = await answer
    return status, orjson.dumps(redact(orjson.loads(body), addresses=True))


async def collect_server_info(parts: InfoParts) -> tuple[int, bytes]:
    """Each server's own info, grouped by role, plus the gateway's view."""
    fleet = parts.fleet

    async def one(server):
        try:
            r = await fleet.client.get(server.url + "/server_info", timeout=fleet.probe_timeout)
            return server, (redact(r.json()) if r.status_code == 200 else {"error": r.status_code})
        except (httpx.HTTPError, ValueError) as exc:
            return server, {"error": type(exc).__name__}

    results = await asyncio.gather(*(one(w) for w in fleet.pool))
    body: dict = {"prefill": [], "decode": [], "internal_states": []}
    for server, info in results:
        if not isinstance(info, dict):
            info = {"error": "not a JSON object"}
        body[server.role].append({"url": server.url, **info})
        if server.role == "decode" and isinstance(info.get("internal_states"), list):
            body["internal_states"].extend(info["internal_states"])
    body["gateway"] = parts.describe()
    return 200, orjson.dumps(body)


async def metrics(request: Request, parts: InfoParts) -> Response:
    cache = parts.fleet.caches.get("metrics", lambda: render_metrics(parts), ttl=METRICS_TTL,
                                   cost_ratio=METRICS_COST_RATIO)
    _, body = await cache.get()
    return Response(body, media_type=CONTENT_TYPE_LATEST)


async def render_metrics(parts: InfoParts) -> tuple[int, bytes]:
    """The page of every metric (the cached computation), with what this process buffered
    published first."""
    parts.metrics.flush()
    return 200, generate_latest(parts.metrics.registry)
