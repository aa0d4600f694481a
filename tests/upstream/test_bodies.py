"""Response framing against raw servers: lengths, chunked edge cases, 1xx, close-delimited
bodies, and bodies cut short (which must be errors, never short successes)."""

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


def test_content_length_request_and_keep_alive(kind):
    async def go():
        async with Server(answering(response(b'{"n":1}'), response(b'{"n":2}'))) as server:
            up = await open_client(kind)
            try:
                assert await call(up, server.url, b'{"text":"a"}') == (200, b'{"n":1}')
                assert await call(up, server.url, b'{"text":"b"}') == (200, b'{"n":2}')
            finally:
                await up.close()
        first, second = server.requests
        assert first.head.startswith(b"POST /generate HTTP/1.1\r\n")
        assert first.header("host") == f"127.0.0.1:{server.port}"
        assert first.header("content-length") == "12" and first.body == b'{"text":"a"}'
        assert first.header("content-type") == "application/json"
        assert first.header("accept-encoding") == "identity"
        assert first.header("x-request-id") == "rid-1"
        assert second.body == b'{"text":"b"}'
        assert len(server.conns) == 1  # the second request reused the connection

    run(go())


CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


def test_chunked_with_extensions_and_trailers_then_reuse(kind):
    body = (b"5;name=value\r\nhello\r\n6;x=\"quoted;semi\"\r\n world\r\n"
            b"0\r\nX-Trailer: t\r\nX-Other: u\r\n\r\n")

    async def go():
        async with Server(answering(CHUNKED + body, response(b"next"))) as server:
            up = await open_client(kind)
            try:
                r = await up.post(server.url, "/generate", b"{}", "r")
                assert r.header(b"x-trailer") is None  # trailers are not headers
                assert await r.read() == b"hello world"
                assert await call(up, server.url) == (200, b"next")
            finally:
                await up.close()
        assert len(server.conns) == 1  # the trailer section was consumed exactly

    run(go())


def test_many_tiny_chunks_each_in_its_own_write(kind):
    async def handler(conn):
        await conn.request()
        await conn.send(CHUNKED)
        for i in range(300):
            await conn.send(b"1\r\n" + bytes([97 + i % 26]) + b"\r\n")
        await conn.send(b"0\r\n\r\n")
        await conn.request()

    async def go():
        async with Server(handler) as server:
            up = await open_client(kind)
            try:
                status, body = await call(up, server.url)
            finally:
                await up.close()
        assert status == 200
        assert body == bytes(97 + i % 26 for i in range(300))

    run(go())


def test_last_chunk_split_across_reads_ends_only_when_complete(kind):
    release = asyncio.Event()

    async def handler(conn):
        await conn.request()
        await conn.send(CHUNKED + b"3\r\nabc\r\n0\r")
        await asyncio.wait_for(release.wait(), WAIT)
        await conn.send(b"\n\r\n")
        if await conn.request() is not None:
            await conn.send(response(b"next"))
            await conn.request()

    async def go():
        async with Server(handler) as server:
            up = await open_client(kind)
            try:
                r = await up.post(server.url, "/generate", b"{}", "r")
                assert await r.next_chunk() == b"abc"
                rest = asyncio.ensure_future(r.next_chunk())
                done, _ = await asyncio.wait([rest], timeout=0.2)
                assert not done, "the body ended before its last chunk was complete"
                release.set()
                assert await asyncio.wait_for(rest, WAIT) is None
                assert await call(up, server.url) == (200, b"next")
            finally:
                await up.close()
        assert len(server.conns) == 1

    run(go())


def test_chunked_body_cut_by_close_is_an_error(kind):
    async def handler(conn):
        await conn.request()
        await conn.send(CHUNKED + b"a\r\n01234")  # 10 announced, 5 sent

    async def go():
        async with Server(handler) as server:
            up = await open_client(kind)
            try:
                with pytest.raises(UpstreamError) as err:
                    await call(up, server.url)
            finally:
                await up.close()
        assert err.value.retryable

    run(go())


def test_content_length_short_then_close_is_an_error(kind):
    async def handler(conn):
        await conn.request()
        await conn.send(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789")

    async def go():
        async with Server(handler) as server:
            up = await open_client(kind)
            try:
                r = await up.post(server.url, "/generate", b"{}", "r")
                assert await r.next_chunk() == b"0123456789"
                with pytest.raises(UpstreamError), translate_errors("decode", WORKER):
                    await r.next_chunk()
                r.abort()
                with pytest.raises(UpstreamError):  # read whole: the same, never 10 bytes
                    await call(up, server.url)
            finally:
                await up.close()

    run(go())


@pytest.mark.parametrize("sent", [b"", b"HTTP/1.1 200 OK\r\nContent-Le"],
                         ids=["before-status", "mid-headers"])
def test_close_before_the_head_is_complete_is_an_error(kind, sent):
    async def handler(conn):
        await conn.request()
        if sent:
            await conn.send(sent)

    async def go():
        async with Server(handler) as server:
            up = await open_client(kind)
            try:
                with pytest.raises(UpstreamError) as err:
                    await call(up, server.url)
            finally:
                await up.close()
        assert err.value.retryable
        assert len(server.requests) == 1  # and it was not sent again

    run(go())


def test_interim_responses_are_skipped(kind):
    interim = (b"HTTP/1.1 100 Continue\r\n\r\n"
               b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n")

    async def go():
        async with Server(answering(interim + response(b"final", extra=b"X-Final: 1\r\n"),
                                    response(b"again"))) as server:
            up = await open_client(kind)
            try:
                r = await up.post(server.url, "/generate", b"{}", "r")
                assert r.status == 200
                assert r.header(b"x-final") == b"1"
                assert r.header(b"link") is None  # the 103's headers are not the answer's
                assert await r.read() == b"final"
                assert await call(up, server.url) == (200, b"again")
            finally:
                await up.close()
        assert len(server.conns) == 1

    run(go())


def test_one_connection_answers_of_every_framing_in_turn(kind):
    """The connection's parser is kept from one answer to the next (llhttp resets itself after
    each message): chunked, interim + length, length, chunked with a trailer, each read whole
    with its own headers only, all on one connection."""
    replies = (
        CHUNKED.replace(b"\r\n\r\n", b"\r\nX-First: 1\r\n\r\n") + b"3\r\none\r\n0\r\n\r\n",
        b"HTTP/1.1 100 Continue\r\n\r\n" + response(b"two", extra=b"X-Second: 2\r\n"),
        response(b"three"),
        CHUNKED + b"4\r\nfour\r\n0\r\nX-Trailer: t\r\n\r\n",
        response(b"five"),
    )

    async def go():
        async with Server(answering(*replies)) as server:
            up = await open_client(kind)
            try:
                seen = []
                for _ in replies:
                    r = await up.post(server.url, "/generate", b"{}", "r")
                    seen.append((r.status, r.header(b"x-first"), r.header(b"x-second"),
                                 await r.read()))
            finally:
                await up.close()
        assert seen == [(200, b"1", None, b"one"), (200, None, b"2", b"two"),
                        (200, None, None, b"three"), (200, None, None, b"four"),
                        (200, None, None, b"five")]
        assert len(server.conns) == 1

    run(go())


@pytest.mark.parametrize("head", [
    b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n",
    b"HTTP/1.0 200 OK\r\n\r\n",
], ids=["http11-close", "http10"])
def test_close_delimited_body_is_read_to_eof(kind, head):
    async def handler(conn):
        await conn.request()
        await conn.send(head + b"first part, ")
        await conn.send(b"second part")
        conn.writer.close()  # the close ends the body

    async def go():
        async with Server(handler) as server:
            up = await open_client(kind)
            try:
                assert await call(up, server.url) == (200, b"first part, second part")
                assert await call(up, server.url) == (200, b"first part, second part")
            finally:
                await up.close()
        assert len(server.conns) == 2  # a close-delimited answer leaves nothing to reuse

    run(go())


def test_no_body_statuses_end_at_the_head(kind):
    async def go():
        async with Server(answering(b"HTTP/1.1 204 No Content\r\n\r\n",
                                    response(b"after"))) as server:
            up = await open_client(kind)
            try:
                assert await call(up, server.url) == (204, b"")
                assert await call(up, server.url) == (200, b"after")
            finally:
                await up.close()
        assert len(server.conns) == 1

    run(go())
