"""Limits: connections per server (waiting in line, bounded), response heads that never end,
and huge bodies streamed with bounded buffering."""

from __future__ import annotations

import asyncio

import pytest

from gateway.errors import UpstreamError
from tests.upstream.raw import WAIT, WORKER, call, open_client, response, run, translate_errors
from tests.upstream.raw import RawServer as Server


def held_answers(gates: dict[int, asyncio.Event]):
    """Each request's answer waits for the gate of its number (1, 2, ...), when it has one."""
    async def handler(conn):
        while (request := await conn.request()) is not None:
            number = len(conn.server.requests)
            gate = gates.get(number)
            if gate is not None:
                await asyncio.wait_for(gate.wait(), WAIT)
            await conn.send(response(b"%d" % number))
            del request
    return handler


def test_a_request_over_the_cap_waits_then_uses_the_released_connection(kind):
    gates = {1: asyncio.Event(), 2: asyncio.Event()}

    async def go():
        async with Server(held_answers(gates)) as server:
            up = await open_client(kind, max_connections=2)
            try:
                first = asyncio.ensure_future(call(up, server.url))
                second = asyncio.ensure_future(call(up, server.url))
                await server.wait_requests(2)
                third = asyncio.ensure_future(call(up, server.url))
                done, _ = await asyncio.wait([third], timeout=0.3)
                assert not done and len(server.conns) == 2 and len(server.requests) == 2
                gates[1].set()
                assert await asyncio.wait_for(first, WAIT) == (200, b"1")
                assert await asyncio.wait_for(third, WAIT) == (200, b"3")
                gates[2].set()
                assert await asyncio.wait_for(second, WAIT) == (200, b"2")
            finally:
                await up.close()
        assert len(server.conns) == 2  # the third went on the first's connection

    run(go())


def test_the_wait_for_a_connection_is_bounded(kind):
    gate = asyncio.Event()

    async def go():
        async with Server(held_answers({1: gate})) as server:
            up = await open_client(kind, max_connections=1, pool_timeout=0.3)
            try:
                first = asyncio.ensure_future(call(up, server.url))
                await server.wait_requests(1)
                loop = asyncio.get_running_loop()
                started = loop.time()
                with pytest.raises(UpstreamError) as err:
                    await call(up, server.url)
                waited = loop.time() - started
                gate.set()
                assert await asyncio.wait_for(first, WAIT) == (200, b"1")
                assert await call(up, server.url) == (200, b"2")  # the place is free again
            finally:
                await up.close()
        assert 0.25 <= waited < 3
        assert err.value.status == 503 and err.value.retryable
        assert "busy" in err.value.message and "upstream-max-connections" in err.value.message
        assert len(server.conns) == 1

    run(go())


def test_a_cancelled_waiter_does_not_lose_the_place(kind):
    gate = asyncio.Event()

    async def go():
        async with Server(held_answers({1: gate})) as server:
            up = await open_client(kind, max_connections=1)
            try:
                first = asyncio.ensure_future(call(up, server.url))
                await server.wait_requests(1)
                waiter = asyncio.ensure_future(call(up, server.url))
                done, _ = await asyncio.wait([waiter], timeout=0.2)
                assert not done
                waiter.cancel()
                gate.set()
                assert await asyncio.wait_for(first, WAIT) == (200, b"1")
                assert await asyncio.wait_for(call(up, server.url), WAIT) == (200, b"2")
            finally:
                await up.close()

    run(go())


def test_a_failed_connect_gives_its_place_back(kind):
    async def go():
        up = await open_client(kind, max_connections=1, pool_timeout=1.0)
        try:
            for _ in range(3):  # port 1 refuses: each attempt fails at once, none waits
                with pytest.raises(UpstreamError) as err:
                    await call(up, "http://127.0.0.1:1")
                assert "busy" not in err.value.message
        finally:
            await up.close()

    run(go())


def test_a_response_head_that_never_ends_is_refused(kind):
    """One header value that goes on and on: the client gives up after a bounded amount (it
    closes the connection while the server is still sending), instead of buffering it all."""
    sent: list[int] = []
    stopped = asyncio.Event()

    async def handler(conn):
        await conn.request()
        await conn.send(b"HTTP/1.1 200 OK\r\nX-Big: ")
        total = 0
        try:
            while total < 64 << 20:
                await conn.send(b"a" * 65536)
                total += 65536
        except ConnectionError:
            pass
        finally:
            sent.append(total)
            stopped.set()

    async def go():
        async with Server(handler) as server:
            up = await open_client(kind)
            try:
                with pytest.raises(UpstreamError):
                    await call(up, server.url)
            finally:
                await up.close()
            await asyncio.wait_for(stopped.wait(), WAIT)  # its writes fail once we left
        assert sent[0] < 16 << 20, f"the client took {sent[0]} bytes of one header"

    run(go())


def test_too_many_headers_are_refused(kind):
    head = b"HTTP/1.1 200 OK\r\n" + b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 40)
                                             for i in range(5000))

    async def handler(conn):
        await conn.request()
        await conn.send(head + b"Content-Length: 2\r\n\r\nok")
        await conn.wait_client_close()

    async def go():
        async with Server(handler) as server:
            up = await open_client(kind)
            try:
                with pytest.raises(UpstreamError):
                    await call(up, server.url)
            finally:
                await up.close()

    run(go())


def test_a_huge_body_streams_with_bounded_buffering(kind):
    """48 MiB announced: while the client reads nothing the server is held back (flow
    control), then the whole body arrives in bounded chunks."""
    size, piece = 48 << 20, 1 << 16
    stalled = asyncio.Event()
    written = []

    async def handler(conn):
        await conn.request()
        await conn.send(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        sent = 0
        while sent < size:
            conn.writer.write(b"x" * piece)
            sent += piece
            try:
                await asyncio.wait_for(conn.writer.drain(), 0.5)
            except TimeoutError:
                if not stalled.is_set():
                    written.append(sent)
                    stalled.set()
                await conn.writer.drain()
        await conn.request()

    async def go():
        async with Server(handler) as server:
            up = await open_client(kind)
            try:
                with translate_errors("decode", WORKER):
                    r = await up.post(server.url, "/generate", b"{}", "r")
                    first = await r.next_chunk()
                    await asyncio.wait_for(stalled.wait(), 15)
                    total, largest = len(first), len(first)
                    while (chunk := await r.next_chunk()) is not None:
                        total += len(chunk)
                        largest = max(largest, len(chunk))
            finally:
                await up.close()
        assert total == size
        assert written[0] < 24 << 20  # the client's buffer + kernel buffers, not the body
        assert largest <= 8 << 20

    run(go(), timeout=60)
