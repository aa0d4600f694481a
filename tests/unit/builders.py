"""Small builders shared by the unit tests: servers with given counters, parsed request views."""

from __future__ import annotations

import time

import orjson

from gateway.request import CHAT, COMPLETIONS, GENERATE, RequestView, parse_request
from gateway.servers.load import ServerLoad
from gateway.servers.pool import Server


def server(url: str, role: str = "prefill", *, in_flight: int = 0, tokens: int = 0,
           load: dict | None = None, age: float | None = None) -> Server:
    """A server; `load` fields form its /v1/loads snapshot, `age` seconds old (None: never)."""
    w = Server(url=url, role=role)
    w.in_flight, w.in_flight_tokens = in_flight, tokens
    w.load = ServerLoad(**(load or {}))
    if age is not None:
        w.load.updated_at = time.monotonic() - age
        AGES[id(w)] = (w, age)
    return w


# Servers built in `parametrize` are made at collection time; a long test run would age their
# snapshots past the freshness limit. conftest.py re-stamps them just before each test.
AGES: dict[int, tuple[Server, float]] = {}


def restamp() -> None:
    now = time.monotonic()
    for w, age in AGES.values():
        w.load.updated_at = now - age


def chat(*messages: tuple[str, str]) -> RequestView:
    body = {"messages": [{"role": r, "content": c} for r, c in messages]}
    return parse_request(CHAT, orjson.dumps(body))


def generate_ids(ids: list[int], **extra: object) -> RequestView:
    return parse_request(GENERATE, orjson.dumps({"input_ids": ids, **extra}))


def generate_text(text: str) -> RequestView:
    return parse_request(GENERATE, orjson.dumps({"text": text}))


def completion(prompt: str) -> RequestView:
    return parse_request(COMPLETIONS, orjson.dumps({"prompt": prompt}))
