"""Startup facts about a server: its PD role, bootstrap port, model and DP size.

Read from `/server_info` (deprecated alias `/get_server_info` on older SGLang). A server
whose `disaggregation_mode` contradicts the role it was given is a configuration error:
sending it the other half of a PD request would fail or, worse, answer empty text.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx

DEFAULT_BOOTSTRAP_PORT = 8998


class RoleMismatch(Exception):
    """The server says it runs in another disaggregation mode than its given role."""


@dataclass(frozen=True)
class ServerFacts:
    mode: str | None
    bootstrap_port: int | None
    model: str | None
    dp_size: int
    kv_events: dict | None = None


async def fetch_server_info(client: httpx.AsyncClient, url: str, timeout: float) -> dict:
    last: Exception | None = None
    for path in ("/server_info", "/get_server_info"):
        try:
            async with asyncio.timeout(timeout):
                response = await client.get(url + path)
        except (httpx.HTTPError, TimeoutError) as exc:
            last = exc
            continue
        if response.status_code == 200:
            try:
                data = response.json()
            except ValueError:
                data = None
            if isinstance(data, dict):
                return data
            last = RuntimeError(f"{url}{path} did not answer a JSON object")
            continue
        last = RuntimeError(f"{url}{path} answered {response.status_code}")
    raise ConnectionError(f"cannot read server info from {url}: {last}")


def facts_from_info(info: dict, url: str, role: str) -> ServerFacts:
    mode = info.get("disaggregation_mode")
    if mode is not None and mode != role:
        raise RoleMismatch(
            f"{url} was given as a {role} server but runs with "
            f"--disaggregation-mode {mode}; fix the --{role} list"
        )
    port = info.get("disaggregation_bootstrap_port")
    model = info.get("served_model_name") or info.get("model_path")
    return ServerFacts(
        mode=mode,
        bootstrap_port=int(port) if port is not None else (
            DEFAULT_BOOTSTRAP_PORT if role == "prefill" else None),
        model=model if isinstance(model, str) else None,
        dp_size=int(info.get("dp_size") or 1),
        kv_events=info.get("kv_events") if isinstance(info.get("kv_events"), dict) else None,
    )


async def probe(client: httpx.AsyncClient, url: str, role: str, timeout: float) -> ServerFacts:
    return facts_from_info(await fetch_server_info(client, url, timeout), url, role)
