"""KV cache events on ZMQ in SGLang's wire format (disaggregation/kv_events.py).

PUB frames are `[topic, seq (8 bytes big-endian), msgpack([ts, events, rank])]`,
one publisher per DP rank on the endpoint's port + rank (the replay port too).
Events are maps tagged by "type" (msgspec `tag=True` structs, as in 0.5.23)
or, with `--kv-events-encoding array`, the older positional arrays
`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium]`. An optional ROUTER socket replays buffered frames: a
client sends `["", start_seq]` and gets every frame from that seq on, then
`["", "", seq=-1, ""]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from backends.sim.config import KvEventsSettings
from backends.sim.radix import CacheEvent

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_WILDCARDS = ("*", "0.0.0.0", "::", "[::]")


def _should_bind(endpoint: str) -> bool:
    return endpoint.startswith(("ipc://", "inproc://")) or any(w in endpoint for w in _WILDCARDS)


def _tcp_host_port(endpoint: str) -> tuple[str, int] | None:
    if not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    try:
        return host, int(port)
    except ValueError:
        return None


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """The endpoint of rank `rank`: tcp port + rank, inproc name + "_dp<rank>".

    mirrors ZmqEventPublisher.offset_endpoint_port (disaggregation/kv_events.py).
    """
    if not endpoint or rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{rank}"
    if "tcp" in endpoint and ":" in endpoint:
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + rank}"
    if "tcp" in endpoint:
        return endpoint
    raise ValueError("Invalid endpoint: must contain 'inproc' or 'tcp'")


def encode_event(event: CacheEvent, page_size: int, array: bool) -> Any:
    """One event as SGLang's msgspec encoder would write it."""
    if event.kind == "BlockStored":
        fields: list[tuple[str, Any]] = [
            ("block_hashes", event.block_hashes),
            ("parent_block_hash", event.parent_block_hash),
            ("token_ids", event.token_ids or []),
            ("block_size", page_size),
            ("lora_id", None),
            ("medium", "GPU"),
        ]
    elif event.kind == "BlockRemoved":
        fields = [("block_hashes", event.block_hashes), ("medium", "GPU")]
    else:
        fields = []
    if array:
        return [event.kind, *(value for _, value in fields)]
    return {"type": event.kind, **dict(fields)}


class KvEventPublisher:
    """Owns the PUB (and optional replay ROUTER) sockets of one server."""

    def __init__(self, settings: KvEventsSettings, page_size: int, encoding: str = "map",
                 dp_rank: int = 0) -> None:
        self.settings = settings
        self.page_size = page_size
        self.dp_rank = dp_rank
        self.endpoint = offset_endpoint(settings.endpoint, dp_rank) or settings.endpoint
        self.replay_endpoint = offset_endpoint(settings.replay_endpoint, dp_rank)
        self.array = encoding == "array"
        self._topic = settings.topic.encode()
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=max(1, settings.buffer_steps))
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(settings.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        bind = settings.bind if settings.bind is not None else _should_bind(self.endpoint)
        if bind:
            self._pub.bind(self.endpoint)
        else:
            self._pub.connect(self.endpoint)
        self._actx: zmq.asyncio.Context | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self.published = 0

    def start_replay(self) -> None:
        """Bind the replay ROUTER, if configured; needs a running loop."""
        if not self.replay_endpoint:
            return
        self._actx = zmq.asyncio.Context()
        self._replay = self._actx.socket(zmq.ROUTER)
        self._replay.setsockopt(zmq.LINGER, 0)
        self._replay.bind(self.replay_endpoint)
        self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay(self._replay))

    def publish(self, events: list[CacheEvent]) -> None:
        """Send one batch; PUB never blocks (frames past HWM are dropped)."""
        # EventBatch [ts, events, attn_dp_rank]: the publisher's rank (ZmqEventPublisher.publish)
        batch = [time.time(), [encode_event(e, self.page_size, self.array) for e in events],
                 self.dp_rank]
        payload = msgpack.packb(batch, use_bin_type=True)
        seq = self._seq
        self._seq += 1
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
        self._buffer.append((seq, payload))
        self.published += 1

    async def _serve_replay(self, router: zmq.asyncio.Socket) -> None:
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await router.send_multipart(
                        [client, b"", self._topic, seq.to_bytes(8, "big"), payload]
                    )
            await router.send_multipart([client, b"", b"", END_SEQ, b""])

    def describe(self, num_dp_ranks: int) -> dict[str, Any] | None:
        """The `kv_events` block of /server_info; mirrors describe_kv_events_publisher
        (runtime_context.py): the base ports, and `dp_size` = the number of ranks."""
        parsed = _tcp_host_port(self.settings.endpoint)
        if parsed is None:
            return None
        info: dict[str, Any] = {
            "publisher": "zmq",
            "endpoint_host": parsed[0],
            "endpoint_port_base": parsed[1],
            "topic": self.settings.topic,
            "block_size": self.page_size,
            "dp_size": num_dp_ranks,
        }
        replay = _tcp_host_port(self.settings.replay_endpoint or "")
        if replay is not None:
            info["replay_endpoint_port_base"] = replay[1]
        return info

    def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
        if self._replay is not None:
            self._replay.close(linger=0)
        self._pub.close(linger=0)
        self._ctx.term()
        if self._actx is not None:
            self._actx.term()
