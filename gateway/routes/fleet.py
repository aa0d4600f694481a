"""The servers as the non-inference routes reach them: the pool, the models, the control
client, and the cached answers; one GET to the first server that answers, one POST to all."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx
import orjson

from gateway.errors import ServiceUnavailable
from gateway.redact import redact
from gateway.routes.info_cache import InfoCaches
from gateway.scheduling.models import Model, Models
from gateway.servers.pool import ServerPool
from gateway.upstream.client import upstream_message


@dataclass(frozen=True, slots=True)
class Fleet:
    """Built with the gateway; the client opens connections only when used."""

    pool: ServerPool
    models: Models
    client: httpx.AsyncClient
    probe_timeout: float
    caches: InfoCaches


async def get_from_any(fleet: Fleet, path: str, model: Model | None = None) -> tuple[int, bytes]:
    """A GET relayed to the first usable server (of `model`, else of any) that answers
    (decode first: it serves the client-visible answer)."""
    pool = fleet.pool
    if model is None:
        servers = pool.usable("decode") + pool.usable("prefill") or list(pool)
    else:
        servers = (model.usable("decode") + model.usable("prefill")
                   or model.servers["decode"] + model.servers["prefill"])
    last = "no servers registered"
    for server in servers:
        try:
            response = await fleet.client.get(server.url + path, timeout=fleet.probe_timeout)
        except httpx.HTTPError as exc:
            last = f"{server.url}: {type(exc).__name__}"
            continue
        if response.status_code == 200:
            return 200, orjson.dumps(redact(response.json()))
        last = f"{server.url} answered {response.status_code}: {upstream_message(response.content)}"
    err = ServiceUnavailable(f"no server could answer {path}: {last}")
    return err.status, orjson.dumps(err.body())


async def post_all(fleet: Fleet, path: str, payload: bytes,
                   servers: list) -> tuple[bool, list[dict]]:
    """`payload` to every one of `servers`, with each one's result."""
    async def one(server):
        try:
            r = await fleet.client.post(server.url + path, content=payload,
                                        headers={"content-type": "application/json"},
                                        timeout=fleet.probe_timeout)
            return {"url": server.url, "role": server.role, "status": r.status_code,
                    "ok": r.status_code < 300, "message": upstream_message(r.content)}
        except httpx.HTTPError as exc:
            return {"url": server.url, "role": server.role, "status": None, "ok": False,
                    "message": f"{type(exc).__name__}: {exc}"}

    results = await asyncio.gather(*(one(w) for w in servers))
    return all(r["ok"] for r in results), list(results)
