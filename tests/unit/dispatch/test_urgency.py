"""Deadlines that shrink as a request waits out silences (health/deadlines.py, `urgency`): a
request that met hung servers in turn paid the whole floor at each (soak seed 22: a streamed
n=2 answer after 30.3 s). Each attempt of the request that failed after waiting halves the
floor of the next attempts' deadlines, down to a fifth of it; the learned part is kept."""

from __future__ import annotations

import time

import pytest

from gateway.health.deadlines import DeadlineOptions, LatencyModel
from gateway.health.queue_wait import DecodeQueue
from gateway.servers.load import ServerLoad
from gateway.servers.pool import Server
from tests.unit.fakes import FakeCluster, FakeServer, run, served

FLOOR = 0.8  # --hang-floor of the end-to-end test (short: a unit test)
CHUNKS = [b'data: {"text": "a"}\n\n', b'data: {"text": "b"}\n\n', b"data: [DONE]\n\n"]


def learned(model: LatencyModel, url: str, seconds: float) -> LatencyModel:
    for _ in range(DeadlineOptions.min_samples):
        model.first_progress(url, 100, seconds)
        ring = model.gaps_of(url)
        model.gap(ring, seconds)
    return model


def test_the_floor_halves_with_each_silence_down_to_a_fifth():
    model = LatencyModel()
    assert [model.floor(u) for u in range(5)] == [5.0, 2.5, 1.25, 1.0, 1.0]


def test_a_quick_server_s_deadlines_follow_the_urgent_floor():
    model = learned(LatencyModel(), "http://p", 0.05)  # 4 x p99 = 0.2 s: the floor rules
    assert model.first_progress_deadline("http://p", 100, 600.0) == 5.0
    assert model.first_progress_deadline("http://p", 100, 600.0, urgency=1) == 2.5
    assert model.gap_deadline("http://p", 600.0, urgency=2) == 1.25
    assert model.answer_deadline("http://p", 3, 600.0, urgency=9) == 1.0
    # an urgent ask leaves the memo of the ordinary deadline alone
    assert model.first_progress_deadline("http://p", 100, 600.0) == 5.0


def test_what_was_learned_is_kept_a_slow_server_is_not_cut_sooner():
    model = learned(LatencyModel(), "http://p", 2.0)  # 4 x p99 = 8 s, over every floor
    assert model.first_progress_deadline("http://p", 100, 600.0, urgency=3) == 8.0


def test_a_cold_server_keeps_its_cold_deadline():
    """Nothing learned of any server: no basis for a short deadline."""
    cold = LatencyModel().first_progress_deadline("http://p", 0, 600.0, urgency=3)
    assert cold == DeadlineOptions.cold


def test_a_queue_s_signs_of_life_are_judged_on_the_ordinary_floor():
    """An urgent request's window (1 s) is shorter than the interval of the /v1/loads polls
    (2 s): judged on it, a decode working through its queue would look silent, and the
    request would be cut and retried over and over (tests/reliability/test_decode_queue.py
    ended three streams 504 so). The queue's evidence keeps the ordinary floor."""
    server = Server(url="http://d0", role="decode", verified=True, model="m")
    now = time.monotonic()
    server.load = ServerLoad(updated_at=now - 1.5, waiting=3)  # its last poll, 1.5 s ago
    kept = DecodeQueue(server, iter([1.0, 2.0]).__next__, least=5.0)
    assert kept.look(now - 1.0, now, 1.0) is not None  # first look: watch its progress
    assert kept.look(now - 1.0, now + 0.5, 1.0) is not None  # it moved: still queued
    assert DecodeQueue(server, iter([1.0]).__next__).look(now - 1.0, now, 1.0) is None


@pytest.mark.timeout(60)
def test_a_request_on_a_hung_decode_is_cut_sooner_at_each_attempt():
    """The only decode hangs after it streamed (its gaps learned). The request's attempts all
    go to it (no other): each arrives when the previous was cut, and the waits shrink,
    0.8 s, 0.4 s, 0.2 s, then stay at 0.16 s. Before, each waited the whole 0.8 s."""
    prefill = FakeServer("prefill")
    decode = FakeServer("decode", chunks=CHUNKS)
    cluster = FakeCluster({"http://p:1": prefill, "http://d:1": decode})

    async def go() -> list[float]:
        async with served(cluster, "--hang-floor", str(FLOOR), "--max-attempts", "5",
                          "--retry-backoff-max", "0.001", "--breaker-failures", "100",
                          "--request-timeout", "30") as (client, _):
            for i in range(6):  # learn its first progress and its gaps
                r = await client.post("/generate", json={"text": f"w{i}", "stream": True})
                assert r.status_code == 200
            decode.hang = True
            decode.arrivals.clear()
            r = await client.post("/generate", json={"text": "x", "stream": True})
            assert r.status_code >= 500
        times = decode.arrivals
        return [b - a for a, b in zip(times, times[1:], strict=False)]

    waits = run(go(), timeout=50)
    assert len(waits) >= 3, waits
    assert waits[0] == pytest.approx(FLOOR, abs=0.15), waits
    assert waits[1] == pytest.approx(FLOOR / 2, abs=0.15), waits
    assert waits[2] == pytest.approx(FLOOR / 4, abs=0.1), waits
    assert all(w >= FLOOR / 5 - 0.02 for w in waits), waits
