"""`--max-queue` with `--workers`: the queue is bounded for the gateway as a whole.

Real processes on loopback: `--workers 2 --max-concurrency 2 --max-queue 4` in front of slow
simulated servers (20 tokens of 100 ms: a request holds its slot 2 s, longer than the burst
takes to arrive even on a busy machine), and 20
requests at once, each on its own connection (so both workers get some). At most 2 + 4 are
let in; the others are refused 429 at once. Before the fix each worker bounded its own queue:
10 were served and 10 refused (2 running + 4 waiting in each worker). The test reads the
gateway's shared block itself, during the burst (admitted and waiting at once) and after
(nothing left counted).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
import time
from pathlib import Path

import httpx
import pytest

from gateway.processes.shared_state import SharedState
from tests.integration.conftest import sim
from tests.procs import HOST, free_port, python, running

REQUESTS, LIMIT, QUEUE = 20, 2, 4


@pytest.fixture
def gateway(tmp_path):
    """A 2-worker gateway, and a view of its shared block (`pdgw-<supervisor pid>`)."""
    with contextlib.ExitStack() as stack:
        port, boot, dport, gw_port = free_port(), free_port(), free_port(), free_port()
        prefill, decode = f"http://{HOST}:{port}", f"http://{HOST}:{dport}"
        slow = ("--token-delay", "0.1")
        stack.enter_context(running("prefill", sim("prefill", port, boot, *slow), tmp_path,
                                    prefill + "/health"))
        stack.enter_context(running("decode", sim("decode", dport, None, *slow), tmp_path,
                                    decode + "/health"))
        argv = python("-m", "gateway", "--host", HOST, "--port", str(gw_port), "--workers", "2",
                      "--prefill", prefill, str(boot), "--decode", decode,
                      "--max-concurrency", str(LIMIT), "--max-queue", str(QUEUE))
        url = f"http://{HOST}:{gw_port}"
        proc = stack.enter_context(running("gateway", argv, tmp_path, url + "/readiness"))
        deadline = time.monotonic() + 30
        while "workers serving" not in proc.log() and time.monotonic() < deadline:
            time.sleep(0.1)  # the supervisor's line once every worker accepts
        name = next(Path("/dev/shm").glob(f"pdgw-{proc.popen.pid}-*")).name  # one per start
        state = SharedState(name, 2, 0, str(tmp_path / "lock"))
        stack.callback(state.close)
        yield url, state


def one(url: str, i: int) -> httpx.Response:
    with httpx.Client(timeout=30) as client:  # a connection of its own
        return client.post(url + "/generate", json={
            "text": f"{os.urandom(4).hex()} queue {i}",
            "sampling_params": {"max_new_tokens": 20}})


def test_the_queue_bound_holds_for_the_whole_gateway_and_nothing_leaks(gateway):
    url, state = gateway
    # slots held and waiters, each bounded on its own (their sum is not: a waiter granted a
    # slot freed in another worker is counted in both for a moment)
    peaks = [0, 0]
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            peaks[0] = max(peaks[0], state.active())
            peaks[1] = max(peaks[1], state.queued())
            time.sleep(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    with concurrent.futures.ThreadPoolExecutor(REQUESTS) as pool:
        answers = list(pool.map(lambda i: one(url, i), range(REQUESTS)))
    stop.set()
    watcher.join(5)
    served = [r for r in answers if r.status_code == 200]
    refused = [r for r in answers if r.status_code == 429]
    assert len(served) + len(refused) == REQUESTS, [r.status_code for r in answers]
    assert all("queue is full" in r.text for r in refused), refused[0].text
    assert LIMIT <= len(served) <= LIMIT + QUEUE, len(served)  # it was 10 to 12
    assert peaks[0] <= LIMIT and peaks[1] <= QUEUE, peaks  # 8 waited before: 4 in each
    deadline = time.monotonic() + 5
    while (state.active() or state.queued()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (state.active(), state.queued()) == (0, 0)  # every slot and place given back
