"""Units of the fast paths: deadline queue, KV channel wire format, coalescing transport."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from backends.sim.deadlines import DeadlineQueue
from backends.sim.httpproto import CoalescingTransport
from backends.sim.wire import BatchWriter, LineReader, take_response


class FakeTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str) -> Any:
        return f"info:{name}"


def test_deadlines_fire_in_order_and_skip_cancelled():
    async def run() -> tuple[list[str], list[bool]]:
        fired: list[str] = []
        queue = DeadlineQueue(0.05)
        a = queue.add(lambda: fired.append("a"))
        b = queue.add(lambda: fired.append("b"))
        await asyncio.sleep(0.01)
        c = queue.add(lambda: fired.append("c"))
        b.cancel()
        await asyncio.sleep(0.03)
        early = list(fired)
        await asyncio.sleep(0.1)
        queue.close()
        return early + ["|"] + fired, [a.expired, b.expired, c.expired]
    order, expired = asyncio.run(run())
    assert order == ["|", "a", "c"]  # nothing before 50 ms; b was cancelled
    assert expired == [True, False, True]


def test_deadline_queue_stays_short_when_entries_are_cancelled():
    async def run() -> int:
        queue = DeadlineQueue(30.0)
        for _ in range(1000):
            queue.add(lambda: None).cancel()
        size = len(queue._entries)
        queue.close()
        return size
    assert asyncio.run(run()) == 1


def test_line_reader_handles_split_lines():
    reader = LineReader()
    assert reader.feed(b'["join", 1, 5, "r"]\n["ab') == [["join", 1, 5, "r"]]
    assert reader.feed(b'ort", 1, "x"]') == []
    assert reader.feed(b"\n") == [["abort", 1, "x"]]
    with pytest.raises(ValueError):
        reader.feed(b"not json\n")


def test_batch_writer_sends_one_write_per_loop_iteration():
    async def run() -> list[bytes]:
        transport = FakeTransport()
        writer = BatchWriter(transport)  # type: ignore[arg-type]
        writer.send(["kv", 1, {"a": 1}])
        writer.send(["failed", 2, "why"])
        assert transport.writes == []
        await asyncio.sleep(0)
        return transport.writes
    assert asyncio.run(run()) == [b'["kv",1,{"a":1}]\n["failed",2,"why"]\n']


def test_take_response():
    buf = bytearray(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhel")
    assert take_response(buf) is None
    buf += b"lo" + b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n"
    assert take_response(buf) == (200, b"hello")
    assert take_response(buf) == (101, b"")
    assert buf == bytearray()
    with pytest.raises(ValueError):
        take_response(bytearray(b"SSH-2.0-OpenSSH\r\n\r\n"))
    with pytest.raises(ValueError):
        take_response(bytearray(b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n"))


def test_coalescing_transport_joins_head_and_body():
    async def run() -> tuple[list[bytes], list[bytes], bool, str]:
        inner = FakeTransport()
        outer = CoalescingTransport(inner, asyncio.get_running_loop())  # type: ignore[arg-type]
        outer.write(b"HTTP/1.1 200 OK\r\n\r\n")
        outer.write(b"body")
        before = list(inner.writes)
        await asyncio.sleep(0)
        after = list(inner.writes)
        outer.write(b"last")
        outer.close()  # flushes first
        return before, after + inner.writes[len(after):], inner.closed, outer.get_extra_info("peername")
    before, after, closed, info = asyncio.run(run())
    assert before == []
    assert after == [b"HTTP/1.1 200 OK\r\n\r\nbody", b"last"]
    assert closed and info == "info:peername"
