"""Honest clients beside an attack, and raw sockets for the attacks themselves.

`Honest` runs client threads that send streaming and non-streaming requests through a gateway
while a test attacks it; leaving the `with` block waits (bounded) for a minimum number of
requests, stops the threads and asserts that every honest request succeeded: a 200 whose
stream ended with `[DONE]` and no error or abort event.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import orjson

from tests.rigs.load import Load, Outcome, failures
from tests.security.rig import HOST, Gateway


class Honest:
    """`loops` client threads (SHAPES[i]: /generate whole, /generate streamed, chat whole, chat
    streamed) through `gateway`, with its inference key unless `headers` are given; see the
    module docstring for what leaving the `with` block checks."""

    def __init__(self, gateway: Gateway, headers: dict | None = None, loops: int = 2,
                 minimum: int = 4, max_new_tokens: int = 4) -> None:
        headers = gateway.headers if headers is None else headers
        self.minimum = minimum  # requests that must have completed before the check
        self.load = Load("", loops, max_new_tokens=max_new_tokens,
                         client=lambda: gateway.client(headers))

    @property
    def outcomes(self) -> list[Outcome]:
        return self.load.outcomes

    def __enter__(self) -> Honest:
        self.load.__enter__()
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is not None:
            self.load.abandon()
            return
        self.check()

    def count(self) -> int:
        return self.load.count()

    def check(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self.count() < self.minimum and time.monotonic() < deadline:
            time.sleep(0.02)
        outcomes = self.load.stop(wait=timeout)
        bad = failures(outcomes)
        assert not bad, f"{len(bad)} of {len(outcomes)} honest requests failed: {bad[:3]}"
        assert len(outcomes) >= self.minimum, \
            f"only {len(outcomes)} honest requests completed in {timeout:g}s"


def connect(port: int, timeout: float = 10.0, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:  # before connect, so the window is small from the start
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(timeout)
    sock.connect((HOST, port))
    return sock


def read_until_closed(sock: socket.socket, timeout: float) -> tuple[bytes, bool]:
    """Everything the server sends until it closes, or until `timeout`: (data, closed)."""
    sock.settimeout(timeout)
    data = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                return data, True
            data += chunk
    except TimeoutError:
        return data, False
    except ConnectionResetError:
        return data, True
    return data, False


def exchange(port: int, raw: bytes, timeout: float = 10.0) -> tuple[bytes, bool]:
    """Send `raw` on a new connection; the answer and whether the server closed it."""
    with connect(port, timeout) as sock:
        sock.sendall(raw)
        return read_until_closed(sock, timeout)


def status_of(answer: bytes) -> int:
    assert answer.startswith(b"HTTP/1.1 "), answer[:200]
    return int(answer[9:12])


def closed_within(sock: socket.socket, timeout: float) -> float | None:
    """Seconds until the server closed `sock` (reading whatever it sent), None if it did not."""
    started = time.monotonic()
    _, closed = read_until_closed(sock, timeout)
    return time.monotonic() - started if closed else None


class Stream(threading.Thread):
    """One long streaming /generate in its own thread (the victim of an attack, or a request
    its own client aborts): `events` are its parsed SSE events, `started` is set when the
    first event with a `meta_info.id` came."""

    def __init__(self, gateway: Gateway, headers: dict | None, tokens: int = 200,
                 request_id: str | None = None, rid: str | None = None) -> None:
        super().__init__(daemon=True)
        self.gateway, self.tokens = gateway, tokens
        self.headers = dict(headers or {})
        if request_id is not None:
            self.headers["x-request-id"] = request_id
        self.body = {"text": f"{os.urandom(4).hex()} a long story", "stream": True,
                     "sampling_params": {"max_new_tokens": tokens}}
        if rid is not None:
            self.body["rid"] = rid
        self.started = threading.Event()
        self.status: int | None = None
        self.request_id: str | None = None
        self.meta_id: str | None = None
        self.events: list = []
        self.done = False  # the stream ended with [DONE]
        self.error: str | None = None

    def run(self) -> None:
        try:
            with self.gateway.client() as client, client.stream(
                    "POST", "/generate", json=self.body, headers=self.headers) as r:
                self.status = r.status_code
                self.request_id = r.headers.get("x-request-id")
                for line in r.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        self.done = True
                        continue
                    event = orjson.loads(data)
                    self.events.append(event)
                    meta = event.get("meta_info") or {}
                    if self.meta_id is None and meta.get("id"):
                        self.meta_id = meta["id"]
                        self.started.set()
        except Exception as exc:  # noqa: BLE001 - reported through `error`
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.started.set()

    def begin(self, timeout: float = 20.0) -> Stream:
        if self.ident is None:
            self.start()
        assert self.started.wait(timeout), "the stream never started"
        assert self.meta_id is not None, (self.status, self.error, self.events[:1])
        return self

    def finish(self, timeout: float = 30.0) -> Stream:
        self.join(timeout)
        assert not self.is_alive(), "the stream did not end"
        return self

    @property
    def finish_reason(self) -> dict | None:
        for event in reversed(self.events):
            reason = (event.get("meta_info") or {}).get("finish_reason")
            if reason:
                return reason
        return None

    @property
    def completed(self) -> bool:
        """Ran to its natural end: every token, no error event, [DONE]."""
        reason = self.finish_reason or {}
        return (self.done and self.status == 200 and reason.get("type") == "length"
                and not any("error" in e for e in self.events))

    @property
    def error_event(self) -> dict | None:
        return next((e["error"] for e in self.events if "error" in e), None)
