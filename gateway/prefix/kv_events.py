"""Follow SGLang KV cache events over ZMQ into a `KvIndex` (a helper, not a policy).

Wire format (SGLang `disaggregation/kv_events.py`, `ZmqEventPublisher`): a PUB socket per
attention-DP rank at port base + rank sends `[topic, seq (8-byte big-endian), msgpack(batch)]`,
batch = `[ts, events, attn_dp_rank]`. An optional ROUTER replay socket answers
`["", start_seq]` with the buffered frames `["", topic, seq, payload]` from start_seq on,
ended by a frame whose seq is -1.

Sequence numbers keep the index honest:
- the next one: apply;
- a gap (frames dropped at the high-water mark or while reconnecting): replay the missing
  frames if a replay endpoint is known and still buffers them, else forget that source's blocks
  (missed removals would leave phantom hits; missing blocks only cost a hit);
- a smaller one: the publisher restarted, and so did its cache: forget and go on;
- the first one after connecting: start from an empty state, and if its seq is > 0 replay from
  0 when possible (best effort: whatever is replayed is a subset of the truth).

One task per source, owned by `KvEventSubscriber`; `stop()` cancels and awaits them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from gateway.prefix.kv_index import KvIndex

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
RETRY_DELAY = 1.0


@dataclass(frozen=True)
class EventSource:
    """One publisher: a server's DP rank and where to reach it."""

    url: str
    rank: int
    endpoint: str
    topic: str = ""
    replay_endpoint: str | None = None

    @property
    def key(self) -> tuple[str, int]:
        return (self.url, self.rank)


def decode_payload(payload: bytes) -> list[Any]:
    """The events of one msgpack batch `[ts, events, attn_dp_rank]`; ValueError if malformed."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ValueError(f"undecodable batch: {exc}") from None
    if not isinstance(batch, (list, tuple)) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError("batch is not [ts, events, ...]")
    return batch[1]


def decode_seq(raw: bytes) -> int:
    if len(raw) != 8:
        raise ValueError(f"sequence frame has {len(raw)} bytes, expected 8")
    return int.from_bytes(raw, "big")


class KvEventSubscriber:
    """Keeps one SUB task per wanted source, feeding `index`."""

    def __init__(self, index: KvIndex, replay_timeout: float = 2.0) -> None:
        self.index = index
        self.replay_timeout = replay_timeout
        self._wanted: dict[tuple[str, int], EventSource] = {}
        self._tasks: dict[tuple[str, int], tuple[EventSource, asyncio.Task]] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self.counters = {"batches": 0, "gaps": 0, "replayed": 0, "restarts": 0, "bad_frames": 0}

    @property
    def running(self) -> bool:
        return self._ctx is not None

    def set_sources(self, sources: Iterable[EventSource]) -> None:
        """The sources to follow from now on; tasks start/stop to match when running."""
        self._wanted = {s.key: s for s in sources}
        if self._ctx is not None:
            self._reconcile()

    async def start(self) -> None:
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
            self._reconcile()

    async def stop(self) -> None:
        tasks = [task for _, task in self._tasks.values()]
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    def _reconcile(self) -> None:
        if self._ctx is None:
            return
        for key, (source, task) in list(self._tasks.items()):
            if self._wanted.get(key) != source:
                task.cancel()
                del self._tasks[key]
        for key, source in self._wanted.items():
            if key not in self._tasks:
                task = asyncio.get_running_loop().create_task(
                    self._follow(self._ctx, source), name=f"kv-events {source.endpoint}"
                )
                self._tasks[key] = (source, task)

    async def _follow(self, ctx: zmq.asyncio.Context, source: EventSource) -> None:
        """Receive frames from `source` forever; reconnects are ZMQ's, errors are retried."""
        last: int | None = None
        while True:
            sock = ctx.socket(zmq.SUB)
            try:
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.IPV6, 1)  # endpoints may be bracketed IPv6 literals
                sock.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
                sock.connect(source.endpoint)
                while True:
                    frames = await sock.recv_multipart()
                    last = await self._receive(ctx, source, frames, last)
            except zmq.ZMQError as exc:
                log.warning("kv events from %s: %s; retrying", source.endpoint, exc)
            except Exception:  # a bug must not silently end the stream for good
                log.exception("kv events from %s: unexpected error; retrying", source.endpoint)
            finally:
                sock.close(linger=0)
            await asyncio.sleep(RETRY_DELAY)

    async def _receive(self, ctx: zmq.asyncio.Context, source: EventSource, frames: list[bytes],
                       last: int | None) -> int | None:
        """Apply one live frame after repairing the sequence; returns the new last seq."""
        try:
            if len(frames) != 3:
                raise ValueError(f"{len(frames)} frames, expected 3")
            seq = decode_seq(frames[1])
            events = decode_payload(frames[2])
        except ValueError as exc:
            self.counters["bad_frames"] += 1
            log.debug("kv events from %s: bad frame: %s", source.endpoint, exc)
            return last
        replay = source.replay_endpoint
        if last is None:
            self.index.clear(source.key)  # whatever an earlier connection left is unverified
            if seq > 0 and replay:
                await self._replay(ctx, replay, source, 0, seq, exact=False)
        elif seq <= last:
            self.counters["restarts"] += 1
            self.index.clear(source.key)
        elif seq > last + 1:
            self.counters["gaps"] += 1
            repaired = replay is not None and await self._replay(
                ctx, replay, source, last + 1, seq, exact=True
            )
            if not repaired:
                log.warning("kv events from %s: lost %d batches; resetting its index",
                            source.endpoint, seq - last - 1)
                self.index.clear(source.key)
        self._apply(source, events)
        return seq

    def _apply(self, source: EventSource, events: list[Any]) -> None:
        self.counters["batches"] += 1
        self.index.apply_batch(source.key, events, time.monotonic())

    async def _replay(self, ctx: zmq.asyncio.Context, endpoint: str, source: EventSource,
                      start: int, stop: int, exact: bool) -> bool:
        """Apply buffered batches [start, stop); with `exact`, only a complete run counts."""
        sock = ctx.socket(zmq.DEALER)
        expected = start
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IPV6, 1)
            sock.connect(endpoint)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await sock.poll(self.replay_timeout * 1000, zmq.POLLIN):
                    return False
                frames = await sock.recv_multipart()
                if len(frames) != 4:
                    return False
                if frames[2] == END_SEQ:
                    return expected >= stop
                seq = decode_seq(frames[2])
                if seq >= stop or seq < expected:
                    continue
                if exact and seq != expected:
                    return False  # the buffer no longer reaches back to `start`
                self._apply(source, decode_payload(frames[3]))
                self.counters["replayed"] += 1
                expected = seq + 1
        except (ValueError, zmq.ZMQError) as exc:
            log.debug("kv events replay from %s failed: %s", endpoint, exc)
            return False
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sock.close(linger=0)

    def stats(self) -> dict:
        return {"sources": len(self._tasks), **self.counters}
