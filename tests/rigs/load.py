"""Client load beside a fault or an attack: a few loops, each sending one request after another.

The fault tests count what each loop saw; the security tests (`tests/security/honest.py`) wrap
the same loops and require every request to succeed. Every request is classified by what its client saw, so a test can say exactly which failures
it tolerates: a non-2xx answer (with its JSON error), a stream that started and then carried an
error event, a stream cut without `[DONE]`, or a transport error; each with its duration.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import orjson

OK = "ok"
HTTP_ERROR = "http_error"  # a non-2xx answer before anything was streamed
STREAM_ERROR = "stream_error"  # 200, streaming started, then an error event and [DONE]
INCOMPLETE = "incomplete"  # a stream that ended without [DONE]
TRANSPORT = "transport"  # connection refused/reset, or a read timeout

# (path, streaming) by loop number: native and OpenAI, whole answers and streams
SHAPES = (("/generate", False), ("/generate", True),
          ("/v1/chat/completions", False), ("/v1/chat/completions", True))


@dataclass(frozen=True)
class Outcome:
    kind: str
    path: str
    stream: bool
    status: int | None
    started: float  # monotonic
    elapsed: float
    detail: str = ""


def request_body(path: str, stream: bool, prompt: str, max_new_tokens: int) -> dict:
    if path == "/generate":
        return {"text": prompt, "stream": stream,
                "sampling_params": {"max_new_tokens": max_new_tokens}}
    return {"model": "sim-model", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_new_tokens, "stream": stream}


def send(client: httpx.Client, url: str, path: str, stream: bool, prompt: str,
         max_new_tokens: int = 8) -> Outcome:
    """One request, classified; never raises for what a server or the network does."""
    body = request_body(path, stream, prompt, max_new_tokens)
    started = time.monotonic()

    def outcome(kind: str, status: int | None, detail: str = "") -> Outcome:
        return Outcome(kind, path, stream, status, started, time.monotonic() - started, detail)

    try:
        with client.stream("POST", url + path, json=body) as response:
            raw = response.read() if not stream else b"".join(response.iter_raw())
            if response.status_code != 200:
                return outcome(HTTP_ERROR, response.status_code, raw[:300].decode(errors="replace"))
            if not stream:
                return outcome(OK, 200)
            return classify_stream(raw, outcome)
    except httpx.HTTPError as exc:
        return outcome(TRANSPORT, None, f"{type(exc).__name__}: {exc}")


def classify_stream(raw: bytes, outcome) -> Outcome:
    events = [e[5:].strip() for e in raw.split(b"\n\n") if e.startswith(b"data:")]
    if not events or events[-1] != b"[DONE]":
        return outcome(INCOMPLETE, 200, raw[-200:].decode(errors="replace"))
    for event in events[:-1]:
        obj = orjson.loads(event)
        reason = (obj.get("meta_info") or {}).get("finish_reason") or {}
        if "error" in obj or (isinstance(reason, dict) and reason.get("type") == "abort"):
            return outcome(STREAM_ERROR, 200, event.decode(errors="replace")[:300])
    return outcome(OK, 200)


@dataclass
class Load:
    """`loops` client threads sending requests until stopped; see SHAPES for their mix.

    Each loop keeps one client: `client()` when given (a gateway's, with its base URL, TLS
    settings and key), else a plain one with `timeout`; requests go to `url` + path."""

    url: str
    loops: int = 4
    timeout: float = 15.0
    max_new_tokens: int = 8
    outcomes: list[Outcome] = field(default_factory=list)
    client: Callable[[], httpx.Client] | None = None

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True)
                         for i in range(self.loops)]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, wait: float | None = None) -> list[Outcome]:
        """End the loops after their current request; each may take `wait` seconds (default:
        the request timeout and 5 s) before it counts as blocked."""
        self._stop.set()
        for thread in self._threads:
            thread.join(self.timeout + 5 if wait is None else wait)
        alive = [t.name for t in self._threads if t.is_alive()]
        assert not alive, f"client loops still blocked after their deadline: {alive}"
        return self.outcomes

    def abandon(self) -> None:
        """Let the loops end on their own: the test failed already, waiting would hide why."""
        self._stop.set()

    def _loop(self, number: int) -> None:
        path, stream = SHAPES[number % len(SHAPES)]
        client = self.client() if self.client is not None else httpx.Client(timeout=self.timeout)
        with client:
            n = 0
            while not self._stop.is_set():
                n += 1
                # no shared prefix: cache_aware spreads these by load, not by cache affinity
                prompt = f"{os.urandom(6).hex()} loop {number} request {n}: fault tolerance"
                result = send(client, self.url, path, stream, prompt, self.max_new_tokens)
                with self._lock:
                    self.outcomes.append(result)

    def count(self, since: float = 0.0) -> int:
        with self._lock:
            return sum(1 for o in self.outcomes if o.started >= since)

    def wait_count(self, n: int, since: float, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.count(since) < n:
            assert time.monotonic() < deadline, f"fewer than {n} requests in {timeout:g}s"
            time.sleep(0.02)


class Stream(threading.Thread):
    """One streaming request in its own thread; `started` is set at its first chunk,
    `ended_at` (monotonic) when its last byte came."""

    def __init__(self, url: str, number: int, tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.number, self.tokens = url, number, tokens
        self.started = threading.Event()
        self.outcome: Outcome | None = None
        self.ended_at = 0.0

    def run(self) -> None:
        path = "/generate" if self.number % 2 else "/v1/chat/completions"
        body = request_body(path, True, f"stream {self.number}", self.tokens)
        begun = time.monotonic()
        raw = b""

        def outcome(kind, status, detail=""):
            return Outcome(kind, path, True, status, begun, time.monotonic() - begun, detail)

        try:
            with httpx.stream("POST", self.url + path, json=body, timeout=30) as response:
                for chunk in response.iter_raw():
                    raw += chunk
                    self.started.set()
            if response.status_code != 200:
                self.outcome = outcome(HTTP_ERROR, response.status_code, raw[:300].decode())
            else:
                self.outcome = classify_stream(raw, outcome)
        except httpx.HTTPError as exc:
            self.outcome = outcome(TRANSPORT, None, f"{type(exc).__name__}: {exc}")
        finally:
            self.ended_at = time.monotonic()
            self.started.set()


def summary(outcomes: list[Outcome]) -> Counter:
    return Counter(o.kind for o in outcomes)


def failures(outcomes: list[Outcome]) -> list[Outcome]:
    return [o for o in outcomes if o.kind != OK]
