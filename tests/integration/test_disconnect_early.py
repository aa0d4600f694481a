"""A client that leaves before its answer began: whatever the request was waiting for (a
server counting its prompt, a slot in the admission queue), the request stops at once, is
counted as a disconnect, and no server is asked to generate for it. Real processes on
loopback: one prefill and one decode simulator and the gateway (tests/rigs/faults.py)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest

from tests.procs import HOST
from tests.rigs.faults import Rig, running_rig, wait_until

CONTEXT = 1000  # the simulators' context: a prompt of 800 estimated tokens is near it
TOKEN_DELAY = 0.02  # seconds per decoded token: a 150-token answer holds the slot ~3 s
GENERATION = ("generate", "chat", "completions")  # the endpoints that do work


@pytest.fixture(scope="module")
def rig(tmp_path_factory) -> Iterator[Rig]:
    # slow health checks: servers frozen for a few seconds are not taken out meanwhile
    gateway = ["--max-concurrency", "1", "--health-interval", "10", "--health-timeout", "10",
               "--loads-interval", "10"]
    sims = ["--context-length", str(CONTEXT), "--token-delay", str(TOKEN_DELAY)]
    with running_rig(tmp_path_factory.mktemp("logs"), gateway, n_prefill=1, n_decode=1,
                     sim_args=sims) as started:
        yield started


def leave_after(rig: Rig, body: dict, seconds: float) -> float:
    """Send `body` to the chat endpoint whole, close the connection after `seconds` without
    reading anything; the monotonic time it left."""
    data = orjson.dumps(body)
    port = int(rig.gateway.rsplit(":", 1)[1])
    with socket.create_connection((HOST, port), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\ncontent-type: "
                     b"application/json\r\ncontent-length: %d\r\n\r\n%s"
                     % (HOST.encode(), len(data), data))
        time.sleep(seconds)
    return time.monotonic()


def disconnects(rig: Rig) -> float:
    return rig.metrics().total("gateway_client_disconnects_total", endpoint="chat")


def answered(rig: Rig, status: str) -> float:
    return rig.metrics().total("gateway_requests_total", endpoint="chat", status=status)


def generations(rig: Rig) -> int:
    """Generation requests the simulators received (tokenize and the like left out)."""
    return sum(count for server in rig.servers
               for path, count in rig.stats(server)["requests"].items()
               if any(name in path for name in GENERATION))


def chat(text: str, max_tokens: int, stream: bool = False) -> dict:
    return {"model": "sim-model", "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "user", "content": text}]}


def test_a_client_gone_while_a_server_counts_its_prompt_stops_the_request_at_once(rig):
    """A prompt near the context is counted by a server's /v1/tokenize before the request
    is admitted; the servers are frozen, so the count waits (up to 2 s, then 503). The client
    leaves at 0.5 s. Before: the departure was told to nobody (the watch was armed after the
    count): the request ran on to its 503, and no disconnect was counted. Now the watch is
    armed once the body is read: the count is cancelled and the disconnect counted at once."""
    before, unavailable, work = disconnects(rig), answered(rig, "503"), generations(rig)
    for server in rig.servers:
        rig.freeze(server)
    try:
        left = leave_after(rig, chat("word " * (CONTEXT * 4 // 5), 4), 0.5)
        took = wait_until(lambda: disconnects(rig) == before + 1, 5.0,
                          "the disconnect counted")
        assert time.monotonic() - left < 1.0, f"counted {took:.2f} s after the poll began"
        time.sleep(2.5)  # past the count's deadline: nothing else comes of the request
        assert answered(rig, "503") == unavailable
        assert answered(rig, "499") >= 1
    finally:
        for server in rig.servers:
            rig.thaw(server)
    time.sleep(0.5)
    assert generations(rig) == work


def test_a_client_gone_while_queued_leaves_the_queue_and_is_never_served(rig):
    """`--max-concurrency 1`: a long stream holds the slot, a second request waits for it,
    and its client leaves. It leaves the queue at once, its disconnect is counted, and once
    the slot frees nothing is sent to the servers for it."""
    before, work = disconnects(rig), generations(rig)
    with httpx.Client(timeout=30) as client, client.stream(
            "POST", rig.gateway + "/v1/chat/completions",
            json=chat("hold the slot", 150, stream=True)) as holder:
        assert holder.status_code == 200
        wait_until(lambda: rig.metrics().total("gateway_admission_active") == 1, 5.0,
                   "the long request holds the slot")
        leave_after(rig, chat("queued then gone", 4), 0.5)
        wait_until(lambda: disconnects(rig) == before + 1, 1.0, "the disconnect counted")
        assert rig.metrics().total("gateway_admission_waiting") == 0
        body = b"".join(holder.iter_bytes())
    assert body.rstrip().endswith(b"data: [DONE]")
    time.sleep(0.5)  # the slot is free: a waiter left behind would be served now
    assert generations(rig) == work + 2  # the holder's two legs, nothing more
