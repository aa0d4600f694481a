"""https servers (verified by default, a CA bundle, or not at all) and IPv6 literal hosts."""

from __future__ import annotations

import asyncio
import socket

import pytest

from gateway.errors import UpstreamError
from gateway.upstream.client import ssl_context
from tests.upstream.raw import WAIT, answering, call, open_client, response, run
from tests.upstream.raw import RawServer as Server


def test_https_needs_the_ca_then_reuses_its_connection(kind, certs):
    async def go():
        async with Server(answering(response(b"a"), response(b"b")), host="127.0.0.1",
                          tls=certs.server_context()) as server:
            assert server.url.startswith("https://")
            up = await open_client(kind, tls=ssl_context())  # system store: not our CA
            try:
                with pytest.raises(UpstreamError) as err:
                    await call(up, server.url)
            finally:
                await up.close()
            assert "certificate" in err.value.message.lower()
            assert err.value.retryable
            assert not server.requests  # nothing was sent over an unverified connection

            up = await open_client(kind, tls=ssl_context(str(certs.ca_file)))
            try:
                assert await call(up, server.url) == (200, b"a")
                assert await call(up, server.url) == (200, b"b")
            finally:
                await up.close()
        # one TLS connection, reused (the failed handshakes never reached the handler)
        assert [r.connection for r in server.requests] == [1, 1]

    run(go())


def test_https_insecure_skips_verification(kind, certs):
    async def go():
        async with Server(answering(response(b"unverified")),
                          tls=certs.server_context()) as server:
            up = await open_client(kind, tls=ssl_context(insecure=True))
            try:
                assert await call(up, server.url) == (200, b"unverified")
            finally:
                await up.close()

    run(go())


def test_https_stream_abort_is_seen_by_the_server(kind, certs):
    left: list[bool] = []
    seen = asyncio.Event()

    async def handler(conn):
        await conn.request()
        await conn.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        left.append(await conn.wait_client_close(WAIT))
        seen.set()

    async def go():
        async with Server(handler, tls=certs.server_context()) as server:
            up = await open_client(kind, tls=ssl_context(str(certs.ca_file)))
            try:
                r = await up.post(server.url, "/generate", b"{}", "r")
                assert await r.next_chunk() == b"hello"
                r.abort()
                await asyncio.wait_for(seen.wait(), WAIT + 1)
            finally:
                await up.close()
        assert left == [True]

    run(go())


def _has_ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_ipv6_literal_host(kind):
    async def go():
        async with Server(answering(response(b"v6"), response(b"v6 again")),
                          host="::1") as server:
            assert server.url.startswith("http://[::1]:")
            up = await open_client(kind)
            try:
                assert await call(up, server.url) == (200, b"v6")
                assert await call(up, server.url) == (200, b"v6 again")
            finally:
                await up.close()
        assert server.requests[0].header("host") == f"[::1]:{server.port}"
        assert len(server.conns) == 1

    run(go())
