"""Prefix cache accounting, LRU eviction and KV cache events on ZMQ."""

from __future__ import annotations

import asyncio
import hashlib
import struct
import time
from typing import Any

import httpx
import msgpack
import pytest
import zmq

from tests.sim.simproc import Sim, free_port

pytestmark = pytest.mark.timeout(60)


def expected_block_hashes(tokens: list[int], page: int, prior: bytes = b"") -> list[int]:
    """SGLang's chain, written independently: sha256(prev digest + page as LE uint32)."""
    out = []
    for start in range(0, len(tokens) - len(tokens) % page, page):
        prior = hashlib.sha256(prior + struct.pack(f"<{page}I", *tokens[start:start + page])).digest()
        out.append(int.from_bytes(prior[:8], "big", signed=True))
    return out


def gen(sim: Sim, ids: list[int], new: int = 1, **extra: Any) -> dict[str, Any]:
    r = sim.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": new},
                                    **extra})
    assert r.status_code == 200, r.text
    return r.json()


class Subscriber:
    def __init__(self, port: int, topic: bytes = b"") -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        time.sleep(0.3)  # PUB/SUB slow joiner

    def events(self, timeout: float = 2.0) -> list[tuple[bytes, int, list[Any]]]:
        out = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.sock.poll(200 if out else 1000):
            topic, seq, payload = self.sock.recv_multipart()
            ts, events, rank = msgpack.unpackb(payload)
            assert isinstance(ts, float) and rank == 0
            out.append((topic, int.from_bytes(seq, "big"), events))
        return out

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def test_cached_tokens_grow_on_repeated_prompt(null_sim: Sim):
    ids = list(range(100, 140))
    assert gen(null_sim, ids)["meta_info"]["cached_tokens"] == 0
    assert gen(null_sim, ids)["meta_info"]["cached_tokens"] == 39  # never the last token
    extended = gen(null_sim, ids + [7, 8, 9])["meta_info"]
    assert extended["cached_tokens"] == 40
    oai = null_sim.post("/v1/completions", json={"prompt": ids, "max_tokens": 1}).json()
    assert oai["usage"]["prompt_tokens_details"]["cached_tokens"] == 39


def test_lru_eviction_under_small_capacity(sim_factory):
    sim = sim_factory("null", "--cache-capacity-tokens", "20")
    a, b, c = list(range(1, 11)), list(range(21, 31)), list(range(41, 51))
    gen(sim, a)
    gen(sim, b)
    assert gen(sim, a)["meta_info"]["cached_tokens"] == 9  # touches a: b is now least recent
    gen(sim, c)  # 30 tokens > 20: evicts b
    assert gen(sim, b)["meta_info"]["cached_tokens"] == 0
    stats = sim.stats()
    assert stats["cache"]["size_tokens"] <= 20 and stats["cache"]["evicted_tokens"] >= 10


def test_page_size_aligns_matches(sim_factory):
    sim = sim_factory("null", "--page-size", "4")
    ids = list(range(1, 11))
    gen(sim, ids)
    assert gen(sim, ids)["meta_info"]["cached_tokens"] == 8


def test_flush_cache(sim_factory):
    sim = sim_factory("null")
    ids = list(range(1, 9))
    gen(sim, ids)
    assert sim.post("/flush_cache").status_code == 200
    assert gen(sim, ids)["meta_info"]["cached_tokens"] == 0
    assert sim.stats()["flush_count"] == 1


def test_decode_reports_prefill_cached_tokens(sim_factory):
    prefill = sim_factory("prefill")
    decode = sim_factory("decode")
    payload = {"input_ids": list(range(1, 21)), "sampling_params": {"max_new_tokens": 3}}

    async def pair(room: int) -> dict[str, Any]:
        body = {**payload, **prefill.pd_fields(room)}
        async with httpx.AsyncClient(timeout=10) as client:
            p, d = await asyncio.gather(client.post(prefill.url + "/generate", json=body),
                                        client.post(decode.url + "/generate", json=body))
        assert p.status_code == d.status_code == 200
        return d.json()["meta_info"]

    assert asyncio.run(pair(1))["cached_tokens"] == 0
    assert asyncio.run(pair(2))["cached_tokens"] == 19


def test_kv_events_hash_chain_eviction_and_clear(sim_factory):
    port = free_port()
    cfg = f'{{"publisher":"zmq","endpoint":"tcp://*:{port}","topic":"kv-events"}}'
    sim = sim_factory("null", "--kv-events-config", cfg, "--cache-capacity-tokens", "12")
    info = sim.get("/server_info").json()
    assert info["kv_events"]["endpoint_port_base"] == port
    assert info["kv_events"]["topic"] == "kv-events" and info["kv_events"]["block_size"] == 1
    sub = Subscriber(port)
    try:
        first = list(range(1, 11))
        gen(sim, first)
        gen(sim, first[:5] + [99, 98])
        gen(sim, [500, 501, 502, 503, 504])  # 10 + 2 + 5 > 12: evicts the oldest leaf
        assert sim.post("/flush_cache").status_code == 200
        got = sub.events()
    finally:
        sub.close()
    assert [t for t, _, _ in got] == [b"kv-events"] * len(got)
    assert [s for _, s, _ in got] == list(range(len(got)))
    events = [e for _, _, batch in got for e in batch]
    chain = expected_block_hashes(first, 1)
    stored = events[0]
    assert stored == {"type": "BlockStored", "block_hashes": chain, "parent_block_hash": None,
                      "token_ids": first, "block_size": 1, "lora_id": None, "medium": "GPU"}
    branch = events[1]
    assert branch["parent_block_hash"] == chain[4]
    assert branch["block_hashes"] == expected_block_hashes(first[:5] + [99, 98], 1)[5:]
    kinds = [e["type"] for e in events]
    assert "BlockRemoved" in kinds and kinds[-1] == "AllBlocksCleared"
    removed = next(e for e in events if e["type"] == "BlockRemoved")
    assert set(removed["block_hashes"]) <= set(chain) | set(branch["block_hashes"])


def test_kv_events_array_encoding_pages_and_replay(sim_factory):
    port, replay = free_port(), free_port()
    cfg = (f'{{"publisher":"zmq","endpoint":"tcp://*:{port}",'
           f'"replay_endpoint":"tcp://*:{replay}"}}')
    sim = sim_factory("null", "--kv-events-config", cfg, "--kv-events-encoding", "array",
                      "--page-size", "4")
    sub = Subscriber(port)
    ids = list(range(1, 11))
    try:
        gen(sim, ids)
        got = sub.events()
    finally:
        sub.close()
    event = got[0][2][0]
    assert event == ["BlockStored", expected_block_hashes(ids, 4), None, ids[:8], 4, None, "GPU"]
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{replay}")
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        frames = []
        while dealer.poll(2000):
            frame = dealer.recv_multipart()
            frames.append(frame)
            if frame[2] == (-1).to_bytes(8, "big", signed=True):
                break
        assert len(frames) == 2
        assert int.from_bytes(frames[0][2], "big") == 0
        assert msgpack.unpackb(frames[0][3])[1][0] == event
    finally:
        dealer.close(linger=0)
        ctx.term()
