"""A body in parts (`base.Body`: a leg's head, the request's shared bytes, the closing brace)
reaches the server as one request with the right length, from every client, small or large."""

from __future__ import annotations

import pytest

from gateway.upstream.base import Body
from tests.upstream.raw import RawServer as Server
from tests.upstream.raw import answering, call, open_client, response, run


@pytest.mark.parametrize("size", [10, 3 << 20], ids=["small-joined", "large-in-parts"])
def test_a_body_in_parts_arrives_whole(kind, size):
    shared = b'{"text":"' + b"x" * size + b'"}'
    body = Body(b'{"bootstrap_room":7,', memoryview(shared)[1:-1], b"}")
    expected = b'{"bootstrap_room":7,"text":"' + b"x" * size + b'"}'

    async def go():
        async with Server(answering(response(b'{"n":1}'), response(b'{"n":2}'))) as server:
            up = await open_client(kind)
            try:
                assert await call(up, server.url, body) == (200, b'{"n":1}')
                assert await call(up, server.url, body) == (200, b'{"n":2}')  # reused parts
            finally:
                await up.close()
        for request in server.requests:
            assert request.header("content-length") == str(len(expected))
            assert request.body == expected
        assert len(server.conns) == 1  # the framing left the connection reusable

    run(go())
