"""The KV event subscriber against a real ZMQ PUB (and ROUTER for replay) on loopback."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import msgpack
import pytest
import zmq
import zmq.asyncio

from gateway.prefix.kv_events import END_SEQ, EventSource, KvEventSubscriber
from gateway.prefix.kv_index import KvIndex

URL = "http://127.0.0.1:30000"
KEY = (URL, 0)


def frame(seq: int, events: list, topic: bytes = b"") -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), msgpack.packb([time.time(), events, 0])]


def stored(hashes: list[int], enc: str = "map") -> object:
    if enc == "array":
        return ["BlockStored", hashes, None, [], 4, None]
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
            "token_ids": [], "block_size": 4, "lora_id": None}


def removed(hashes: list[int], enc: str = "map") -> object:
    return ["BlockRemoved", hashes] if enc == "array" else {"type": "BlockRemoved",
                                                            "block_hashes": hashes}


def cleared(enc: str = "map") -> object:
    return ["AllBlocksCleared"] if enc == "array" else {"type": "AllBlocksCleared"}


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


class Harness:
    """A publisher (and optional replay server) plus a subscriber following it."""

    def __init__(self, replay: bool = False, topic: str = "") -> None:
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind("tcp://127.0.0.1:*")
        self.router = None
        replay_endpoint = None
        if replay:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.bind("tcp://127.0.0.1:*")
            replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.buffer: list[list[bytes]] = []  # every frame "published", for replay
        self.index = KvIndex(max_blocks=1000)
        self.subscriber = KvEventSubscriber(self.index, replay_timeout=2.0)
        self.subscriber.set_sources([EventSource(
            URL, 0, self.pub.getsockopt_string(zmq.LAST_ENDPOINT), topic, replay_endpoint)])
        self.seq = 0
        self.topic = topic.encode()
        self.replay_task: asyncio.Task | None = None

    async def __aenter__(self) -> Harness:
        await self.subscriber.start()
        if self.router is not None:
            self.replay_task = asyncio.create_task(self._serve_replay())
        # Slow joiner: probe with empty batches until one gets through.
        deadline = time.monotonic() + 5.0
        while URL not in self.index._last_event:
            if time.monotonic() > deadline:
                raise AssertionError("subscriber never connected")
            await self.send([], topic=self.topic)
            await asyncio.sleep(0.02)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.subscriber.stop()
        if self.replay_task is not None:
            self.replay_task.cancel()
            await asyncio.gather(self.replay_task, return_exceptions=True)
        self.ctx.destroy(linger=0)

    async def send(self, events: list, live: bool = True, topic: bytes = b"") -> None:
        """Publish the next batch (`live=False`: only buffer it, as if the SUB dropped it)."""
        frames = frame(self.seq, events, topic)
        self.seq += 1
        self.buffer.append(frames)
        if live:
            await self.pub.send_multipart(frames)

    async def _serve_replay(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            for frames in self.buffer:
                if int.from_bytes(frames[1], "big") >= first:
                    await self.router.send_multipart([client, b"", *frames])
            await self.router.send_multipart([client, b"", b"", END_SEQ, b""])


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout=20))


@pytest.mark.parametrize("enc", ["map", "array"])
def test_live_events_update_the_index(enc: str) -> None:
    async def body() -> None:
        async with Harness() as h:
            await h.send([stored([1, 2, 3], enc)])
            await until(lambda: h.index.blocks_of(KEY) == {1, 2, 3})
            await h.send([removed([2], enc)])
            await until(lambda: h.index.blocks_of(KEY) == {1, 3})
            await h.send([cleared(enc), stored([9], enc)])
            await until(lambda: h.index.blocks_of(KEY) == {9})
            assert h.index.block_size(URL) == 4

    run(body())


def test_gap_without_replay_resets_the_worker() -> None:
    async def body() -> None:
        async with Harness() as h:
            await h.send([stored([1])])
            await h.send([removed([1])], live=False)  # lost: 1 would stay as a phantom
            await h.send([stored([2])])
            await until(lambda: 2 in h.index.blocks_of(KEY))
            assert h.index.blocks_of(KEY) == {2}
            assert h.subscriber.counters["gaps"] == 1

    run(body())


def test_gap_is_repaired_from_the_replay_socket() -> None:
    async def body() -> None:
        async with Harness(replay=True) as h:
            before = h.subscriber.counters["replayed"]  # joining late replays the probes
            await h.send([stored([1])])
            await h.send([stored([2]), removed([1])], live=False)
            await h.send([stored([3])], live=False)
            await h.send([stored([4])])
            await until(lambda: 4 in h.index.blocks_of(KEY))
            assert h.index.blocks_of(KEY) == {2, 3, 4}
            assert h.subscriber.counters["gaps"] == 1
            assert h.subscriber.counters["replayed"] - before == 2

    run(body())


def test_publisher_restart_resets_the_worker() -> None:
    async def body() -> None:
        async with Harness() as h:
            await h.send([stored([1])])
            await until(lambda: h.index.blocks_of(KEY) == {1})
            h.seq = 0  # the server restarted: numbering starts again, its cache is empty
            await h.send([stored([5])])
            await until(lambda: h.index.blocks_of(KEY) == {5})
            assert h.subscriber.counters["restarts"] == 1

    run(body())


def test_bad_frames_are_counted_and_skipped() -> None:
    async def body() -> None:
        async with Harness() as h:
            await h.pub.send_multipart([b"", b"\x00\x01", b"junk"])
            await h.send([stored([7])])
            await until(lambda: h.index.blocks_of(KEY) == {7})
            assert h.subscriber.counters["bad_frames"] == 1

    run(body())


def test_topic_filters_frames() -> None:
    async def body() -> None:
        async with Harness(topic="kv") as h:
            await h.send([stored([1])], topic=b"other")
            await h.send([stored([2])], topic=b"kv")
            await until(lambda: 2 in h.index.blocks_of(KEY))
            assert 1 not in h.index.blocks_of(KEY)

    run(body())


def test_stop_cancels_every_task() -> None:
    async def body() -> None:
        async with Harness() as h:
            tasks = [task for _, task in h.subscriber._tasks.values()]
            assert tasks and h.subscriber.running
        assert all(task.done() for task in tasks)
        assert not h.subscriber.running and not h.subscriber._tasks

    run(body())
