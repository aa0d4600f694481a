"""Load test of an OpenAI-compatible gateway with locust: chat and completions, streaming or not.

    pip install -e '.[load]'
    locust -f loadtests/locustfile.py --headless -u 16 -r 8 -t 20s --host http://127.0.0.1:8000

Besides the requests themselves, every stream reports two custom metrics as request events
(type "SSE", so they appear in the stats table, the charts and `--csv` files):

* "TTFT chat" / "TTFT completions": time from sending the request to the first token
  (the first event with non-empty content or text);
* "ITL chat" / "ITL completions": each gap between two consecutive token events.

A request fails when the status is not 200, the answer is not valid JSON, an event carries an
"error", a stream ends without `data: [DONE]`, or no token came back.

Settings (environment variables):

| variable | default | meaning |
|---|---|---|
| LOAD_MODEL | first id of GET /v1/models, else "default" | model name sent |
| LOAD_MAX_TOKENS | 64 | max_tokens of every request |
| LOAD_PROMPT_WORDS | 20-200 | words per prompt, drawn uniformly from MIN-MAX |
| LOAD_SHARED_PREFIX_WORDS | 0 | words of a system prompt shared by all requests (prefix cache) |
| LOAD_WEIGHTS | chat_stream=4,chat=2,completions_stream=2,completions=1 | task mix |
| LOAD_API_KEY | unset | sent as `Authorization: Bearer ...` |
| LOAD_TIMEOUT | 120 | seconds per request |
"""

from __future__ import annotations

import json
import os
import random
import time
import urllib.request

from locust import HttpUser, between, events, task

WORDS = ("time person year way day thing man world life hand part child eye woman place work "
         "week case point number group problem fact river light storm harbour keeper lamp "
         "wave rock ship night sea cloud wind bell door stair window letter voice").split()


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _words_range() -> tuple[int, int]:
    low, _, high = os.environ.get("LOAD_PROMPT_WORDS", "20-200").partition("-")
    low_n = int(low)
    return low_n, int(high or low_n)


def _weights() -> dict[str, int]:
    spec = os.environ.get("LOAD_WEIGHTS", "chat_stream=4,chat=2,completions_stream=2,"
                                          "completions=1")
    out = {}
    for item in spec.split(","):
        name, _, weight = item.partition("=")
        out[name.strip()] = int(weight or 1)
    return out


MAX_TOKENS = _env_int("LOAD_MAX_TOKENS", 64)
PROMPT_WORDS = _words_range()
SHARED_PREFIX = " ".join(random.Random(7).choice(WORDS)
                         for _ in range(_env_int("LOAD_SHARED_PREFIX_WORDS", 0)))
WEIGHTS = _weights()
TIMEOUT = float(os.environ.get("LOAD_TIMEOUT", 120))
API_KEY = os.environ.get("LOAD_API_KEY")
settings = {"model": os.environ.get("LOAD_MODEL")}


@events.test_start.add_listener
def _discover_model(environment, **_kwargs) -> None:
    """Without LOAD_MODEL, ask the gateway which model it serves."""
    if settings["model"] or not environment.host:
        return
    request = urllib.request.Request(environment.host.rstrip("/") + "/v1/models")
    if API_KEY:
        request.add_header("Authorization", f"Bearer {API_KEY}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            settings["model"] = json.load(response)["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError):
        settings["model"] = "default"


def _prompt() -> str:
    words = " ".join(random.choice(WORDS) for _ in range(random.randint(*PROMPT_WORDS)))
    return f"Write about {words}."


class StreamError(Exception):
    pass


class GatewayUser(HttpUser):
    wait_time = between(0.0, 0.5)

    def on_start(self) -> None:
        if API_KEY:
            self.client.headers["Authorization"] = f"Bearer {API_KEY}"

    # --- the four request kinds ---------------------------------------------------------------
    @task(WEIGHTS.get("chat_stream", 0))
    def chat_stream(self) -> None:
        self._stream("/v1/chat/completions", self._chat_body(), "chat")

    @task(WEIGHTS.get("chat", 0))
    def chat(self) -> None:
        self._plain("/v1/chat/completions", self._chat_body(), "chat")

    @task(WEIGHTS.get("completions_stream", 0))
    def completions_stream(self) -> None:
        self._stream("/v1/completions", self._completion_body(), "completions")

    @task(WEIGHTS.get("completions", 0))
    def completions(self) -> None:
        self._plain("/v1/completions", self._completion_body(), "completions")

    # --- bodies -------------------------------------------------------------------------------
    def _chat_body(self) -> dict:
        messages = [{"role": "user", "content": _prompt()}]
        if SHARED_PREFIX:
            messages.insert(0, {"role": "system", "content": SHARED_PREFIX})
        return {"model": settings["model"] or "default", "messages": messages,
                "max_tokens": MAX_TOKENS}

    def _completion_body(self) -> dict:
        prefix = SHARED_PREFIX + "\n" if SHARED_PREFIX else ""
        return {"model": settings["model"] or "default", "prompt": prefix + _prompt(),
                "max_tokens": MAX_TOKENS}

    # --- sending ------------------------------------------------------------------------------
    def _plain(self, path: str, body: dict, kind: str) -> None:
        with self.client.post(path, json=body, name=path, timeout=TIMEOUT,
                              catch_response=True) as response:
            if response.status_code != 200:
                response.failure(f"status {response.status_code}: {response.text[:200]}")
                return
            try:
                choice = response.json()["choices"][0]
                text = choice["message"]["content"] if kind == "chat" else choice["text"]
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                response.failure(f"unexpected answer ({exc!r}): {response.text[:200]}")
                return
            if not text:
                response.failure("empty answer")

    def _stream(self, path: str, body: dict, kind: str) -> None:
        body = {**body, "stream": True}
        name = f"{path} stream"
        start = time.perf_counter()
        with self.client.post(path, json=body, name=name, timeout=TIMEOUT, stream=True,
                              catch_response=True) as response:
            if response.status_code != 200:
                response.failure(f"status {response.status_code}: {response.text[:200]}")
                return
            try:
                token_times = self._read_events(response, kind)
            except StreamError as exc:
                response.failure(str(exc))
                return
        self._report(f"TTFT {kind}", (token_times[0] - start) * 1000)
        for earlier, later in zip(token_times, token_times[1:], strict=False):
            self._report(f"ITL {kind}", (later - earlier) * 1000)

    @staticmethod
    def _read_events(response, kind: str) -> list[float]:
        """Arrival times of the token events; raises StreamError on a bad stream."""
        token_times: list[float] = []
        done = False
        for line in response.iter_lines():
            if not line or not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                done = True
                break
            try:
                event = json.loads(payload)
            except ValueError as exc:
                raise StreamError(f"bad event {payload[:100]!r}") from exc
            if "error" in event:
                raise StreamError(f"error event: {payload[:200]!r}")
            for choice in event.get("choices") or []:
                piece = ((choice.get("delta") or {}).get("content") if kind == "chat"
                         else choice.get("text"))
                if piece:
                    token_times.append(time.perf_counter())
                    break
        if not done:
            raise StreamError("stream ended without data: [DONE]")
        if not token_times:
            raise StreamError("stream without any token")
        return token_times

    def _report(self, name: str, milliseconds: float) -> None:
        self.environment.events.request.fire(
            request_type="SSE", name=name, response_time=milliseconds, response_length=0,
            exception=None, context={})
