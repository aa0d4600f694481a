"""What the parallel-sampling e2e modules share: the requests and the constants."""

from __future__ import annotations

import json
from typing import Any

import httpx

N = 2
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog"]
TOKENS = [[74, 75, 427, 262], [437, 400, 286]]  # token ids of the tiny model's vocabulary
MODEL = "tiny-llama"
IDLE_WAIT = 15.0  # seconds the servers get to report no running or waiting request


def post(url: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(url, json=body, timeout=timeout, trust_env=False)


def whole(url: str, path: str, body: dict) -> Any:
    response = post(url + path, body)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/json")
    return response.json()


def stream(url: str, path: str, body: dict) -> list[dict]:
    """The JSON objects of an SSE answer, checked: 200, text/event-stream, every event a JSON
    object, exactly one `[DONE]`, and it comes last."""
    response = post(url + path, body)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [line[len("data:"):].strip() for line in response.text.splitlines()
              if line.startswith("data:")]
    assert events and events.count("[DONE]") == 1 and events[-1] == "[DONE]", events[-3:]
    objects = [json.loads(event) for event in events[:-1]]
    assert all(isinstance(o, dict) and "error" not in o for o in objects), objects
    return objects
