"""A request leaves no reference cycle behind: what it allocated is freed by reference
counting as it ends, not by the cyclic collector.

Why it matters: one cycle per request (an attempt and its request pointing at each other)
kept every object of the request alive until a collection, and the collections it caused
cost about 6% of the gateway's CPU under load (docs/BENCHMARKS.md, "Reference cycles"). The
gateway runs here as users run it, behind the PD stub of the benchmarks, with a probe of the
collector (tests/integration/gc_probe.py)."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from loadtests.cluster import cluster
from tests.procs import HOST, ROOT, free_port, python, running

ROUNDS = 30
SHAPES = [
    ("/generate", {"text": "a prompt", "sampling_params": {"max_new_tokens": 4}}),
    ("/generate", {"text": "a prompt", "stream": True, "sampling_params": {"max_new_tokens": 4}}),
    ("/generate", {"text": "a prompt", "sampling_params": {"max_new_tokens": 4, "n": 2}}),
    ("/v1/chat/completions", {"model": "stub-model", "max_tokens": 4,
                              "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/chat/completions", {"model": "stub-model", "max_tokens": 4, "stream": True,
                              "stream_options": {"include_usage": True},
                              "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"model": "stub-model", "max_tokens": 4, "prompt": "once upon"}),
]


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    out = logs / "garbage.json"
    with cluster("stub", 2, None, logs) as servers:
        port = free_port()
        gateway = python(str(ROOT / "tests/integration/gc_probe.py"), "--host", HOST,
                         "--port", str(port), "--prefill", servers.prefill_url,
                         str(servers.bootstrap_port))
        for decode in servers.decode_urls:
            gateway += ["--decode", decode]
        with running("gateway", gateway, logs, f"http://{HOST}:{port}/readiness",
                     env={"GC_PROBE_OUT": str(out)}) as proc:
            yield f"http://{HOST}:{port}", proc, out


def garbage_of(proc, out, send) -> dict:
    """What the collector found only through cycles while `send()` ran: gateway objects by
    type (`gateway`), and the number of objects of any type (`all`)."""
    os.kill(proc.popen.pid, signal.SIGUSR1)
    time.sleep(0.2)  # the handler runs on the gateway's next loop turn
    send()
    out.unlink(missing_ok=True)
    os.kill(proc.popen.pid, signal.SIGUSR2)
    deadline = time.monotonic() + 10
    while not out.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return json.loads(out.read_text())


@pytest.mark.parametrize(("path", "body"), SHAPES,
                         ids=["generate", "generate-stream", "generate-n2", "chat",
                              "chat-stream", "completions"])
def test_requests_leave_no_cycles(probed, path, body):
    url, proc, out = probed

    def send() -> None:
        with httpx.Client(base_url=url, timeout=10) as client:
            for _ in range(ROUNDS):
                r = client.post(path, json=body)
                assert r.status_code == 200, r.text

    found = garbage_of(proc, out, send)["gateway"]
    assert not found, f"reference cycles after {ROUNDS} requests: {found}"


def test_the_probe_sees_the_cycle_it_is_for(tmp_path, monkeypatch):
    """The probe is not blind: the cycle this test was written for (a request's record and
    its attempt pointing at each other) is reported by type."""
    from gateway.dispatch.inflight import Tracked
    from tests.integration import gc_probe

    out = tmp_path / "garbage.json"
    monkeypatch.setenv("GC_PROBE_OUT", str(out))
    gc_probe._start()
    try:
        tracked = Tracked("request-id", "owner")
        tracked.attempts.add(Tracked("attempt", "owner", attempts={tracked}))
        del tracked
    finally:
        gc_probe._report()
    found = json.loads(out.read_text())
    assert found["gateway"] == {"gateway.dispatch.inflight.Tracked": 2}
    assert found["all"] >= 2
