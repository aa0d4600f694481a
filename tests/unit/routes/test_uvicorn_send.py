"""`UvicornSend` against the uvicorn it copies: the same bytes and the same cycle state as
uvicorn's own `send` for the same answer, and `response_complete` doing what uvicorn's
`on_response_complete` does short of its timer. A uvicorn release outside the range the copy
follows fails here first (the socket-level tests are in tests/security/test_whole_answers.py
and test_stream_chunks.py)."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest
import uvicorn
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from gateway.routes.uvicorn_send import UVICORN_VERSIONS, UvicornSend
from tests.rigs.transport import Transport

DATE = [(b"date", b"Tue, 01 Dec 2026 16:00:00 GMT"), (b"server", b"uvicorn")]
HEADERS = [(b"content-type", b"application/json"), (b"x-request-id", b"abc")]
STATE = ("response_started", "response_complete", "waiting_for_100_continue", "keep_alive",
         "disconnected")


class UvicornTransport(Transport):
    """What uvicorn's cycle also asks of its transport."""

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def cycle(keep_alive: bool = True) -> RequestResponseCycle:
    """A real uvicorn cycle on a recording transport, as the protocol makes one."""
    transport = UvicornTransport()
    made = RequestResponseCycle(
        scope={"type": "http", "method": "POST", "path": "/generate", "http_version": "1.1",
               "headers": [], "client": None, "query_string": b""},
        transport=transport, flow=FlowControl(transport), logger=logging.getLogger("t"),
        access_logger=logging.getLogger("t.access"), access_log=False,
        default_headers=list(DATE), message_event=asyncio.Event(), expect_100_continue=True,
        keep_alive=keep_alive, on_response=lambda: setattr(made, "answered", True))
    made.answered = False
    return made


def state(made: RequestResponseCycle) -> tuple:
    return tuple(getattr(made, name) for name in STATE) + (
        b"".join(made.transport.writes), made.transport.closed, made.message_event.is_set(),
        made.answered)


def test_the_installed_uvicorn_is_one_the_copy_follows():
    assert tuple(int(part) for part in uvicorn.__version__.split(".")[:2]) in UVICORN_VERSIONS


@pytest.mark.parametrize("keep_alive", [True, False])
def test_whole_writes_once_what_send_writes_twice(keep_alive: bool):
    body = b'{"text": "hello"}'
    ours, theirs = cycle(keep_alive), cycle(keep_alive)
    assert UvicornSend(ours).whole(200, HEADERS, body)
    length = [(b"content-length", b"%d" % len(body))]

    async def send() -> None:
        await theirs.send({"type": "http.response.start", "status": 200,
                           "headers": HEADERS + length})
        await theirs.send({"type": "http.response.body", "body": body})

    asyncio.run(send())
    assert len(ours.transport.writes) == 1 and len(theirs.transport.writes) == 2
    assert state(ours) == state(theirs)


def test_chunks_are_framed_as_send_frames_them():
    ours, theirs = cycle(), cycle()

    written: list[bool] = []

    async def send(made: RequestResponseCycle, chunks: list[bytes]) -> None:
        await made.send({"type": "http.response.start", "status": 200, "headers": HEADERS})
        for chunk in chunks:
            if made is ours:
                written.append(UvicornSend(made).chunk(chunk))
            else:
                await made.send({"type": "http.response.body", "body": chunk,
                                 "more_body": True})
        await made.send({"type": "http.response.body", "body": b"", "more_body": False})

    chunks = [b"data: {}\n\n", b"x" * 300]
    asyncio.run(send(ours, chunks))
    asyncio.run(send(theirs, chunks))
    assert written == [True, True]
    assert state(ours) == state(theirs)
    assert ours.response_complete and ours.answered


def test_it_declines_when_send_would_wait():
    made = cycle()
    made.flow.write_paused = True
    assert not UvicornSend(made).whole(200, HEADERS, b"{}")
    assert made.transport.writes == [] and not made.response_started


def protocol(pipeline: list | None = None, closing: bool = False) -> SimpleNamespace:
    """The fields of uvicorn's HttpToolsProtocol that `response_complete` reads and calls."""
    calls: list = []
    return SimpleNamespace(
        server_state=SimpleNamespace(total_requests=0), calls=calls,
        transport=SimpleNamespace(is_closing=lambda: closing), pipeline=pipeline or [],
        flow=SimpleNamespace(resume_reading=lambda: calls.append("resume")),
        _unset_keepalive_if_required=lambda: calls.append("unset"),
        _start_asgi_task=lambda cycle, app: calls.append(("start", cycle, app)))


def test_response_complete_waits_for_the_next_request():
    conn = protocol()
    assert UvicornSend.response_complete(conn)
    assert conn.server_state.total_requests == 1 and conn.calls == ["unset", "resume"]


def test_response_complete_starts_a_pipelined_request():
    conn = protocol(pipeline=[("cycle", "app")])
    assert not UvicornSend.response_complete(conn)
    assert conn.calls == ["unset", "resume", ("start", "cycle", "app")] and not conn.pipeline


def test_response_complete_on_a_closing_connection_only_counts():
    conn = protocol(closing=True)
    assert not UvicornSend.response_complete(conn)
    assert conn.server_state.total_requests == 1 and conn.calls == []
