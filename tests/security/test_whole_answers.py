"""A complete answer in one write (uvicorn_send.UvicornSend.whole), at the socket level.

The non-streamed answers of the inference endpoints bypass uvicorn's two-message `send`: the
status line, headers and body go out in one `transport.write`. These tests hold it to what
uvicorn's `send` gives the same answer: keep-alive, pipelining, HTTP/1.0 and `connection:
close`, exact content-length, the date header; and, on a stand-in cycle, that it is one write
and that it declines whenever `send` would have to wait or refuse.
"""

from __future__ import annotations

import asyncio
import socket

import httptools
import orjson

from gateway.routes.uvicorn_send import UvicornSend
from tests.rigs.transport import Transport
from tests.security.honest import connect, read_until_closed

BODY = b'{"text": "one write", "sampling_params": {"max_new_tokens": 2}}'


def request(rid: bytes, version: bytes = b"1.1", extra: bytes = b"") -> bytes:
    return (b"POST /generate HTTP/" + version + b"\r\nhost: gateway\r\n"
            b"content-type: application/json\r\nx-request-id: " + rid + b"\r\n" + extra
            + b"content-length: %d\r\n\r\n" % len(BODY) + BODY)


class Answers:
    """Parses every response on a connection, as a client's HTTP/1.1 parser does."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.done: list[dict] = []
        self._current: dict = {}

    def on_message_begin(self) -> None:
        self._current = {"headers": {}, "body": b""}

    def on_header(self, name: bytes, value: bytes) -> None:
        self._current["headers"][name.lower()] = value

    def on_headers_complete(self) -> None:
        self._current["status"] = self.parser.get_status_code()
        self._current["keep_alive"] = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self._current["body"] += body

    def on_message_complete(self) -> None:
        self.done.append(self._current)

    def read(self, sock: socket.socket, count: int, timeout: float = 20.0) -> list[dict]:
        sock.settimeout(timeout)
        while len(self.done) < count:
            data = sock.recv(65536)
            assert data, f"closed after {len(self.done)} of {count} answers"
            self.parser.feed_data(data)
        return self.done


def check(answer: dict, rid: bytes) -> None:
    assert answer["status"] == 200, answer
    headers = answer["headers"]
    assert headers[b"x-request-id"] == rid
    assert int(headers[b"content-length"]) == len(answer["body"])
    assert headers[b"content-type"].startswith(b"application/json")
    assert b"date" in headers  # uvicorn's default header, as its own send writes it
    assert "text" in orjson.loads(answer["body"])


def test_answers_on_one_kept_alive_connection(fast):
    with connect(fast.port) as sock:
        answers = Answers()
        for n in range(3):
            rid = b"keep-%d" % n
            sock.sendall(request(rid))
            got = answers.read(sock, n + 1)[n]
            check(got, rid)
            assert got["keep_alive"]


def test_pipelined_requests_are_answered_in_order(fast):
    rids = [b"pipe-%d" % n for n in range(4)]
    with connect(fast.port) as sock:
        sock.sendall(b"".join(request(rid) for rid in rids))
        got = Answers().read(sock, len(rids))
    for answer, rid in zip(got, rids, strict=True):
        check(answer, rid)


def test_http_1_0_and_connection_close_end_the_connection(fast):
    for raw in (request(b"old-client", b"1.0"), request(b"closing", extra=b"connection: close\r\n")):
        with connect(fast.port) as sock:
            sock.sendall(raw)
            data, closed = read_until_closed(sock, 20)
        assert closed, raw
        answers = Answers()
        answers.parser.feed_data(data)
        (answer,) = answers.done
        assert answer["status"] == 200
        assert answer["headers"][b"connection"] == b"close"
        assert int(answer["headers"][b"content-length"]) == len(answer["body"])


class Flow:
    write_paused = False




class Cycle:
    """The fields of uvicorn's RequestResponseCycle that UvicornSend reads and sets."""

    def __init__(self, keep_alive: bool = True) -> None:
        self.response_started = self.response_complete = self.disconnected = False
        self.waiting_for_100_continue = True
        self.keep_alive = keep_alive
        self.flow = Flow()
        self.transport = Transport()
        self.default_headers = [(b"date", b"Tue, 01 Dec 2026 16:00:00 GMT")]
        self.message_event = asyncio.Event()
        self.completed = 0

    def on_response(self) -> None:
        self.completed += 1


HEADERS = [(b"content-type", b"application/json"), (b"x-request-id", b"abc")]


def test_one_write_with_everything_send_would_set():
    cycle = Cycle(keep_alive=False)
    assert UvicornSend(cycle).whole(200, HEADERS, b'{"a": 1}')
    (data,) = cycle.transport.writes
    assert data == (b"HTTP/1.1 200 OK\r\ndate: Tue, 01 Dec 2026 16:00:00 GMT\r\n"
                    b"content-type: application/json\r\nx-request-id: abc\r\n"
                    b"content-length: 8\r\nconnection: close\r\n\r\n{\"a\": 1}")
    assert cycle.response_started and cycle.response_complete
    assert not cycle.waiting_for_100_continue
    assert cycle.message_event.is_set() and cycle.transport.closed and cycle.completed == 1


def test_it_declines_where_send_must_wait_or_refuse():
    for spoil in ("response_started", "disconnected", "paused", "bad value", "gone"):
        cycle = Cycle()
        headers = list(HEADERS)
        if spoil == "paused":
            cycle.flow.write_paused = True
        elif spoil == "bad value":
            headers = [(b"content-type", b"text/html\r\nset-cookie: x=1")]
        elif spoil != "gone":
            setattr(cycle, spoil, True)
        whole = UvicornSend(cycle).whole
        if spoil == "gone":  # the cycle is held weakly: a finished request's is let go
            del cycle
            assert not whole(200, headers, b"{}")
            continue
        assert not whole(200, headers, b"{}"), spoil
        assert cycle.transport.writes == [] and cycle.completed == 0, spoil
