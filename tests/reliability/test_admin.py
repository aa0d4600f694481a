"""Runtime server management under traffic: drain a decode, remove one and add it back.

Drain: new requests avoid the server at once, the streams it serves run to the end, and the
drain call answers when its in-flight count reaches 0. Remove: the server leaves the pool at
once while its streams finish; added back, it is probed and serves again.
"""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest

from tests.procs import free_port
from tests.rigs.faults import FAST_DETECTION, wait_until
from tests.rigs.load import Stream

TOKENS = 40  # 2 s of streaming at 0.05 s per token
SIM_ARGS = ("--token-delay", "0.05")
SERVERS = "/admin/servers"


def start_streams(rig, count: int) -> list[Stream]:
    streams = [Stream(rig.gateway, n, TOKENS) for n in range(count)]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.started.wait(20), "a stream never started"
    return streams


def busiest_decode(rig):
    snapshots = rig.snapshots()
    return max(rig.decode, key=lambda s: snapshots[s.url]["in_flight"])


def short_requests(rig, count: int) -> None:
    """Requests with unrelated prompts (no shared prefix for cache_aware to follow)."""
    with httpx.Client(timeout=30) as client:
        for _ in range(count):
            prompt = f"{os.urandom(8).hex()} short"
            r = client.post(rig.gateway + "/generate",
                            json={"text": prompt, "sampling_params": {"max_new_tokens": 2}})
            assert r.status_code == 200, r.text


def traffic_reaches(rig, server) -> None:
    """Send short requests until the server has received one (bounded)."""
    count = rig.stats(server)["received"]

    def reached() -> bool:
        short_requests(rig, 2)
        return rig.stats(server)["received"] > count

    wait_until(reached, 15, f"traffic reaches {server.name} again")


@pytest.mark.timeout(90)
def test_drain_waits_for_in_flight_and_diverts_new_requests(make_rig, timing):
    rig = make_rig(*FAST_DETECTION, sim_args=SIM_ARGS)
    streams = start_streams(rig, 6)
    victim = busiest_decode(rig)
    assert rig.snapshot(victim)["in_flight"] >= 1
    received = rig.stats(victim)["received"]
    answer: dict = {}

    def drain() -> None:
        r = httpx.post(rig.gateway + "/admin/servers/drain", timeout=30,
                       json={"url": victim.url, "timeout": 20})
        answer.update(status=r.status_code, body=r.json(), at=time.monotonic())

    drainer = threading.Thread(target=drain)
    drainer.start()
    wait_until(lambda: rig.snapshot(victim)["draining"], 5, "the server is draining")
    short_requests(rig, 10)  # while the drain waits: all must avoid the victim
    drainer.join(30)
    for stream in streams:
        stream.join(30)

    assert answer["status"] == 200 and answer["body"]["drained"] is True, answer
    assert rig.stats(victim)["received"] == received, "a new request reached a draining server"
    assert all(s.outcome.kind == "ok" for s in streams), [s.outcome for s in streams]
    last_end = max(s.ended_at for s in streams)
    assert answer["at"] < last_end + 1.0, "the drain answered long after its last stream"
    timing("drain (POST /admin/servers/drain)", "answered after the last stream ended",
           max(0.0, answer["at"] - last_end))
    snapshot = rig.snapshot(victim)
    assert snapshot["in_flight"] == 0 and not snapshot["usable"] and snapshot["draining"]
    assert rig.metrics().value("gateway_server_usable", server=victim.url) == 0

    httpx.post(rig.gateway + "/admin/servers/undrain", json={"url": victim.url},
               timeout=10).raise_for_status()
    traffic_reaches(rig, victim)

    # nothing to send decodes to: not ready, and requests get 503 with Retry-After
    for server in rig.decode:
        httpx.post(rig.gateway + "/admin/servers/drain", json={"url": server.url, "timeout": 10},
                   timeout=30).raise_for_status()
    assert httpx.get(rig.gateway + "/readiness", timeout=10).status_code == 503
    r = httpx.post(rig.gateway + "/generate", json={"text": "nowhere"}, timeout=10)
    assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["message"]


@pytest.mark.timeout(90)
def test_remove_and_add_back_at_runtime(make_rig):
    rig = make_rig(*FAST_DETECTION, sim_args=SIM_ARGS)
    admin = httpx.Client(base_url=rig.gateway, timeout=30)
    streams = start_streams(rig, 4)
    victim = busiest_decode(rig)
    assert rig.snapshot(victim)["in_flight"] >= 1

    removed = admin.request("DELETE", SERVERS, json={"url": victim.url})
    assert removed.status_code == 200 and removed.json()["removed"]["url"] == victim.url
    assert victim.url not in rig.snapshots()
    assert not rig.metrics().total("gateway_server_usable", server=victim.url)
    received = rig.stats(victim)["received"]
    short_requests(rig, 10)
    assert rig.stats(victim)["received"] == received, "a removed server got a request"
    for stream in streams:
        stream.join(30)
    assert all(s.outcome.kind == "ok" for s in streams), "in-flight streams finish"
    wait_until(lambda: rig.in_flight() == 0, 10, "in-flight counters of the rest drain")

    wrong = admin.post(SERVERS, json={"url": victim.url, "role": "prefill"})
    assert wrong.status_code == 400 and "decode" in wrong.json()["error"]["message"], wrong.text
    added = admin.post(SERVERS, json={"url": victim.url, "role": "decode"})
    assert added.status_code == 201, added.text
    assert added.json()["server"]["verified"] and added.json()["server"]["usable"]
    traffic_reaches(rig, victim)

    prefill = rig.prefill[0]  # a prefill goes and comes back with its bootstrap port
    assert admin.request("DELETE", SERVERS, json={"url": prefill.url}).status_code == 200
    added = admin.post(SERVERS, json={"url": prefill.url, "role": "prefill",
                                 "bootstrap_port": prefill.bootstrap_port})
    assert added.status_code == 201 and added.json()["server"]["usable"], added.text
    traffic_reaches(rig, prefill)

    # refusals: twice the same server, an unknown one, a bad URL
    assert admin.post(SERVERS, json={"url": victim.url + "/", "role": "decode"}).status_code == 409
    assert admin.request("DELETE", SERVERS, json={"url": "http://127.0.0.1:1"}).status_code == 404
    assert admin.post(SERVERS, json={"url": "not a url", "role": "decode"}).status_code == 400
    # a URL that does not answer as an SGLang server of that role is refused, not kept
    absent = f"http://127.0.0.1:{free_port()}"
    joined = admin.post(SERVERS, json={"url": absent, "role": "decode"})
    assert joined.status_code == 400 and "did not answer" in joined.json()["error"]["message"]
    assert absent not in rig.snapshots()
    short_requests(rig, 4)
