"""Connection reuse: a dirty connection is never reused, a POST is never sent twice, and an
abandoned response closes its connection (the server must see the client leave)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.errors import UpstreamError
from tests.upstream.raw import (
    WAIT,
    WORKER,
    answering,
    call,
    open_client,
    response,
    run,
    translate_errors,
)
from tests.upstream.raw import RawServer as Server

STREAM_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def _event(n: int) -> bytes:
    data = b"data: {\"n\": %d}\n\n" % n
    return b"%x\r\n%s\r\n" % (len(data), data)


def streaming_then_answering(closed: list[bool]):
    """First connection: a stream that never ends (records whether the client left);
    later connections answer normally."""
    async def handler(conn):
        if conn.index == 1:
            await conn.request()
            await conn.send(STREAM_HEAD + _event(1) + _event(2))
            closed.append(await conn.wait_client_close())
            return
        await answering(response(b"fresh"))(conn)
    return handler


def test_abort_of_a_half_read_stream_closes_it_and_is_not_reused(kind):
    closed: list[bool] = []

    async def go():
        async with Server(streaming_then_answering(closed)) as server:
            up = await open_client(kind)
            try:
                r = await up.post(server.url, "/generate", b"{}", "r")
                assert (await r.next_chunk()).startswith(b"data: {\"n\": 1}")
                r.abort()
                assert await call(up, server.url) == (200, b"fresh")
            finally:
                await up.close()
            await server.wait_requests(2)
        assert closed == [True]  # the server saw the client leave mid-stream
        assert [req.connection for req in server.requests] == [1, 2]

    run(go())


def test_cancelled_read_then_abort_is_not_reused(kind):
    closed: list[bool] = []

    async def go():
        async with Server(streaming_then_answering(closed)) as server:
            up = await open_client(kind)
            try:
                r = await up.post(server.url, "/generate", b"{}", "r")
                await r.next_chunk()
                waiting = asyncio.ensure_future(r.next_chunk())  # nothing more will come
                await asyncio.sleep(0)
                waiting.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await waiting
                r.abort()
                assert await call(up, server.url) == (200, b"fresh")
            finally:
                await up.close()
        assert closed == [True]
        assert len(server.conns) == 2

    run(go())


def test_cancel_while_waiting_for_the_head_closes_the_connection(kind):
    closed: list[bool] = []

    async def handler(conn):
        if conn.index == 1:
            await conn.request()  # and never answer
            closed.append(await conn.wait_client_close())
            return
        await answering(response(b"fresh"))(conn)

    async def go():
        async with Server(handler) as server:
            up = await open_client(kind)
            try:
                with pytest.raises(TimeoutError):  # the caller's own deadline, untranslated
                    async with asyncio.timeout(0.3):
                        await call(up, server.url)
                assert await call(up, server.url) == (200, b"fresh")
            finally:
                await up.close()
        assert closed == [True]
        assert len(server.requests) == 2 and len(server.conns) == 2

    run(go())


@pytest.mark.parametrize("kind", ["fast", pytest.param("aiohttp", marks=pytest.mark.xfail(
    strict=True, reason="aiohttp 3.14 reuses a connection whose parser holds the start of a "
    "second response (should_close() does not see it); the next request then fails"))])
def test_bytes_after_the_response_make_the_connection_unusable(kind):
    async def handler(conn):
        stray = b"HTTP/1.1 200 OK\r\nContent-Le" if conn.index == 1 else b""
        await answering(response(b"ok" if conn.index == 1 else b"clean") + stray)(conn)

    async def go():
        async with Server(handler) as server:
            up = await open_client(kind)
            try:
                assert await call(up, server.url) == (200, b"ok")
                assert await call(up, server.url) == (200, b"clean")
            finally:
                await up.close()
        assert len(server.conns) == 2  # the connection with stray bytes was not reused

    run(go())


def test_no_resend_when_a_kept_alive_connection_fails_after_the_request(kind):
    """SGLang answers a resent request 400 "Duplicate request ID" (or the room clashes): a
    request written to a connection that then dies is reported, never sent again."""
    async def handler(conn):
        if await conn.request() is None:
            return
        await conn.send(response(b"first"))
        await conn.request()  # the second request arrives on the same connection...
        # ...and the server goes away without answering (a crash, a restart)

    async def go():
        async with Server(handler) as server:
            up = await open_client(kind)
            try:
                assert await call(up, server.url) == (200, b"first")
                with pytest.raises(UpstreamError) as err:
                    await call(up, server.url)
            finally:
                await up.close()
        assert err.value.retryable  # the caller may retry elsewhere, with new rooms
        assert len(server.requests) == 2, "the request was resent"
        assert len(server.conns) == 1

    run(go())


def test_an_idle_connection_closed_by_the_server_is_not_used(kind):
    """The server closes a kept-alive connection (its keep-alive timeout, a restart): the EOF
    is seen before the next request is written, so that request goes on a new connection and
    succeeds, sent once."""
    async def handler(conn):
        if await conn.request() is None:
            return
        await conn.send(response(b"one"))
        if conn.index == 1:
            conn.writer.close()  # idle close right after the answer
            return
        await conn.request()

    async def go():
        async with Server(handler) as server:
            up = await open_client(kind)
            try:
                assert await call(up, server.url) == (200, b"one")
                await asyncio.wait_for(server.conns[0].writer.wait_closed(), WAIT)
                await asyncio.sleep(0.2)  # the client's loop reads the FIN meanwhile
                assert await call(up, server.url) == (200, b"one")
            finally:
                await up.close()
        assert len(server.requests) == 2 and len(server.conns) == 2

    run(go())


def test_slow_server_head_byte_by_byte(kind):
    reply = response(b'{"slow":true}', extra=b"X-Slow: yes\r\n")

    async def handler(conn):
        await conn.request()
        for i in range(len(reply)):
            await conn.send(reply[i:i + 1])
            await asyncio.sleep(0.002)
        await conn.request()

    async def go():
        async with Server(handler) as server:
            up = await open_client(kind)
            try:
                with translate_errors("decode", WORKER):
                    r = await up.post(server.url, "/generate", b"{}", "r")
                    assert r.header(b"x-slow") == b"yes"
                    assert await r.read() == b'{"slow":true}'
            finally:
                await up.close()

    run(go())


def test_slow_stream_chunks_arrive_one_by_one(kind):
    """Each event is handed over when it arrives, not when the body ends."""
    gates = [asyncio.Event() for _ in range(3)]

    async def handler(conn):
        await conn.request()
        await conn.send(STREAM_HEAD)
        for n, gate in enumerate(gates):
            await asyncio.wait_for(gate.wait(), WAIT)
            await conn.send(_event(n))
        await conn.send(b"0\r\n\r\n")
        await conn.request()

    async def go():
        async with Server(handler) as server:
            up = await open_client(kind)
            try:
                r = await up.post(server.url, "/generate", b"{}", "r")
                for n, gate in enumerate(gates):
                    gate.set()
                    chunk = await asyncio.wait_for(r.next_chunk(), WAIT)
                    assert chunk == b"data: {\"n\": %d}\n\n" % n
                assert await asyncio.wait_for(r.next_chunk(), WAIT) is None
            finally:
                await up.close()

    run(go())
