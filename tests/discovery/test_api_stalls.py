"""The pods API client and PodWatch against answers that stall, trickle, overflow or break.

Each test stands for one defect found by a hunt (/tmp/hunt/k8s_hang): a watch line split at
U+0085, a LIST or watch that a byte now and then kept alive forever, a LIST timeout below
the API server's own, a line without end held in memory, and an unexpected exception that
ended a role's discovery for good. Streams that must stall are served from 127.0.0.1 by
`StallServer` (FakeKube answers whole, or not at all); the rest use httpx.MockTransport.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from gateway.discovery import kubeapi
from gateway.discovery.kubeapi import ApiError, KubeAPI
from tests.discovery.fakekube import make_pod
from tests.discovery.harness import discovering, eventually, run, url

SERVER = "https://k8s.test:6443"
CHUNKED = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
           b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n")
TICK = 0.1  # seconds between the bytes of a trickling answer

Mode = Callable[[asyncio.StreamWriter], Awaitable[None]]


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class StallServer:
    """HTTP on 127.0.0.1 that reads a request, then hands the connection to `mode`."""

    def __init__(self, mode: Mode) -> None:
        self.mode = mode
        self.requests = 0
        self._server: asyncio.AbstractServer | None = None
        self._handlers: set[asyncio.Task] = set()

    async def __aenter__(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        # The modes never end by themselves: cancel them (3.11's wait_closed does not wait).
        self._server.close()
        for task in self._handlers:
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._handlers.add(asyncio.current_task())
        try:
            await reader.readuntil(b"\r\n\r\n")
            self.requests += 1
            await self.mode(writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except asyncio.CancelledError:
            pass  # our own __aexit__; a cancelled handler is logged as an error by 3.11
        finally:
            writer.close()


async def silent(writer: asyncio.StreamWriter) -> None:
    """Never a byte: the connection stays open."""
    await asyncio.Event().wait()


def ticks(data: bytes) -> Mode:
    """A watch stream: `data` every TICK seconds, forever (each read timeout starts over)."""
    async def mode(writer: asyncio.StreamWriter) -> None:
        writer.write(CHUNKED)
        while True:
            writer.write(chunk(data))
            await writer.drain()
            await asyncio.sleep(TICK)
    return mode


async def trickled_list(writer: asyncio.StreamWriter) -> None:
    """A LIST answer whose body comes a byte every TICK seconds, never whole."""
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                 b"connection: close\r\ncontent-length: 100000\r\n\r\n")
    while True:
        writer.write(b" ")
        await writer.drain()
        await asyncio.sleep(TICK)


def mock_api(handler: Callable[[httpx.Request], httpx.Response], **kwargs) -> KubeAPI:
    return KubeAPI(SERVER, transport=httpx.MockTransport(handler), **kwargs)


def streamed(pieces: list[bytes]) -> Callable[[httpx.Request], httpx.Response]:
    """A watch answer sent as these chunks, each one read separately by the client."""
    async def body() -> AsyncIterator[bytes]:
        for piece in pieces:
            yield piece
    return lambda request: httpx.Response(200, content=body())


async def collect(api: KubeAPI, timeout_seconds: int = 30) -> list[dict]:
    stream = api.watch_pods("default", "app=x", "5", timeout_seconds)
    try:
        async with contextlib.aclosing(stream):
            return [event async for event in stream]
    finally:
        await api.aclose()


# -- 1. a watch line is cut at b"\n" only -----------------------------------------------------

ODD = "a\u0085b\u2028c\u2029d"  # str.splitlines() breaks at each; JSON may hold them raw


@pytest.mark.parametrize("size", [None, 1], ids=["whole", "byte-by-byte"])
def test_raw_line_separators_inside_a_string_stay_in_their_event(size):
    pods = [make_pod(f"p{i}", annotations={"note": ODD}) for i in range(2)]
    body = b"".join(json.dumps({"type": "ADDED", "object": pod}, ensure_ascii=False)
                    .encode() + b"\n" for pod in pods)
    assert "\u0085".encode() in body  # written raw, as Go's encoding/json does
    pieces = [body] if size is None else [body[i:i + size] for i in range(len(body))]
    events = run(collect(mock_api(streamed(pieces))), 5)
    assert [e["object"]["metadata"]["annotations"]["note"] for e in events] == [ODD, ODD]


# -- 2. every request ends: a total deadline, not only per read ------------------------------

@pytest.mark.parametrize("data", [b"\n", b" "], ids=["blank-lines", "spaces"])
def test_a_trickling_watch_ends_once_it_outlives_its_timeout(monkeypatch, data):
    monkeypatch.setattr(kubeapi, "READ_SLACK", 0.5)  # deadline: 1 s + 0.5 s

    async def go() -> float:
        async with StallServer(ticks(data)) as server:
            started = time.monotonic()
            with pytest.raises(ApiError, match="outlived"):
                await asyncio.wait_for(collect(KubeAPI(server), timeout_seconds=1), 4)
            return time.monotonic() - started

    elapsed = run(go(), 6)
    assert 1.4 <= elapsed < 3.0


@pytest.mark.parametrize("mode", [trickled_list, silent], ids=["trickle", "silent"])
def test_a_list_page_has_a_total_deadline(mode):
    async def go() -> float:
        async with StallServer(mode) as server:
            api = KubeAPI(server, list_deadline=0.5)  # the read timeout stays 60 s
            started = time.monotonic()
            with pytest.raises(ApiError, match="within 0.5s"):
                await asyncio.wait_for(api.list_pods("default", "app=x"), 4)
            await api.aclose()
            return time.monotonic() - started

    assert 0.4 <= run(go(), 6) < 2.0


# -- 3. a LIST may take as long as the API server allows it ----------------------------------

def test_a_list_the_server_takes_35_seconds_for_succeeds():
    """The transport stands for an API server that answers after 35 s (APF queueing): it
    answers when the client's read timeout would wait that long, else times out at once."""
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.update(request.extensions["timeout"])
        if (seen["read"] or 0) < 35:
            raise httpx.ReadTimeout("the server is still working on it", request=request)
        return httpx.Response(200, json={"metadata": {"resourceVersion": "9"}, "items": []})

    api = mock_api(handler)
    assert run(api.list_pods("default", "app=x"), 5) == ([], "9")
    assert seen["read"] >= 60 and seen["connect"] == 5  # the server's own limit is 60 s
    assert api.list_deadline > seen["read"]  # the page deadline leaves the read its time


# -- 4. a watch line has a ceiling ---------------------------------------------------------------

def test_a_line_without_end_is_given_up_at_the_cap():
    piece, cap = 64 << 10, 1 << 20
    sent = []

    async def body() -> AsyncIterator[bytes]:
        for _ in range(64):  # 4 MiB without a newline, then the stream ends
            sent.append(piece)
            yield b"x" * piece

    api = mock_api(lambda request: httpx.Response(200, content=body()), max_line=cap)
    with pytest.raises(ApiError, match=f"over {cap} bytes"):
        run(collect(api), 5)
    assert sum(sent) <= cap + piece  # it stopped reading at the cap, not at the end


def test_a_big_event_under_the_cap_still_passes():
    pod = make_pod("big", annotations={"pad": "y" * (200 << 10)})
    line = json.dumps({"type": "ADDED", "object": pod}).encode() + b"\n"
    pieces = [line[i:i + 4096] for i in range(0, len(line), 4096)]
    events = run(collect(mock_api(streamed(pieces), max_line=256 << 10)), 5)
    assert [e["object"]["metadata"]["name"] for e in events] == ["big"]


# -- 5. answers nobody foresaw are ApiErrors; anything else does not end discovery --------------

@pytest.mark.parametrize("line", [
    b'{"type": "ADDED", "object": "x"}',
    b'{"type": "MODIFIED", "object": [1]}',
    b'{"type": "DELETED", "object": null}',
    b"[" * 100_000,
    b'{"type": "ERROR", "object": {"code": 500, "details": "not an object"}}',
], ids=["string-object", "list-object", "null-object", "nested-too-deep", "bad-status"])
def test_a_malformed_watch_event_is_an_api_error(line):
    with pytest.raises(ApiError):
        run(collect(mock_api(streamed([line + b"\n"]))), 5)


@pytest.mark.parametrize("body", [
    b"[]", b'"x"', b'{"metadata": "x"}', b'{"metadata": {}, "items": 5}', b"[" * 100_000,
], ids=["array", "string", "metadata-string", "items-number", "nested-too-deep"])
def test_a_malformed_list_is_an_api_error(body):
    api = mock_api(lambda request: httpx.Response(200, content=body))
    with pytest.raises(ApiError, match="LIST pods"):
        run(api.list_pods("default", "app=x"), 5)


@pytest.mark.parametrize("token", [b"\xff\xfe token", "t\u00e9".encode()],
                         ids=["not-utf8", "not-ascii"])
def test_a_token_file_that_is_not_text_is_an_api_error(tmp_path, token):
    path = tmp_path / "token"
    path.write_bytes(token)
    api = mock_api(lambda request: httpx.Response(200, json={}), token_file=str(path))
    with pytest.raises(ApiError, match="cannot read the API token"):
        run(api.list_pods("default", "app=x"), 5)


def test_an_unexpected_error_is_logged_and_discovery_goes_on(caplog):
    """A pod whose status is no object breaks PodWatch._apply (AttributeError): the role's
    watch task must log it, LIST again with backoff, and see the changes that follow."""
    caplog.set_level(logging.WARNING, logger="gateway.discovery")

    def break_status(pod: dict) -> None:
        pod["status"] = "broken"

    async def go() -> None:
        async with discovering(make_pod("d0", role="decode", ip="10.0.1.1")) as (
                fake, pool, discovery):
            fake.modify("d0", break_status)
            await eventually(lambda: any(
                r.exc_info and r.exc_info[0] is AttributeError for r in caplog.records),
                what="the error logged")
            fake.delete("d0")
            fake.add(make_pod("d1", role="decode", ip="10.0.1.2"))
            await eventually(lambda: pool.urls("decode") == {url("10.0.1.2")},
                             what="d1 in place of d0")
            assert all(not t.done() for t in discovery._tasks)

    run(go(), 10)
