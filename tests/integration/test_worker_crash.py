"""Workers of `--workers` killed with something else going on.

1. Killed under load, with the concurrency limit full and requests queued: the other
workers' queued requests are still served.

Two faults at once: a crash while the gateway is at its limit. A worker publishes in shared
memory the slots it holds, its legs' in-flight counts and its most urgent waiter; killed, it
could not take them back. Before the supervisor forgot a dead worker's figures
(`SharedState.forget_worker`), its slot held the gateway's capacity and its waiter made the
other workers' queues yield to a request that was gone: every queued request on the live
worker waited out `--queue-timeout` and got a 503, and the servers' in-flight gauges kept the
dead worker's legs.

2. Killed after an operator changed the server set: the workers started again serve the
operator's set, not the command line's (the supervisor replays the admin changes,
`processes/control_channel.py`).

3. Killed while another worker waits out its restart backoff: it is started again after its
own backoff, and SIGTERM is obeyed at once.

Real processes on loopback: the supervisor, two workers, simulators.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import socket
import time

import httpx
import orjson
import psutil
import pytest

from tests.integration.conftest import sim
from tests.integration.test_workers import worker_pids
from tests.procs import HOST, free_port, python, running

QUEUED = 8  # requests queued behind the held slot, spread over both workers
QUEUE_TIMEOUT = 10  # seconds; the queued requests need about 2 s once the slot is free


@pytest.fixture
def cluster(tmp_path):
    with contextlib.ExitStack() as stack:
        port, boot, dport = free_port(), free_port(), free_port()
        prefill, decode = f"http://{HOST}:{port}", f"http://{HOST}:{dport}"
        stack.enter_context(running("prefill", sim("prefill", port, boot, "--token-delay",
                                                   "0.02"), tmp_path, prefill + "/health"))
        stack.enter_context(running("decode", sim("decode", dport, None, "--token-delay",
                                                  "0.02"), tmp_path, decode + "/health"))
        gateway, gw_port, proc = two_workers(stack, tmp_path, prefill, boot, [decode],
                                             "--max-concurrency", "1",
                                             "--queue-timeout", str(QUEUE_TIMEOUT))
        yield {"gateway": gateway, "port": gw_port, "proc": proc}


def two_workers(stack: contextlib.ExitStack, log_dir, prefill: str, boot: int,
                decodes: list[str], *extra: str):
    """A gateway of 2 workers in front of them, once both serve: (URL, port, its Proc)."""
    gw_port = free_port()
    argv = python("-m", "gateway", "--host", HOST, "--port", str(gw_port), "--workers", "2",
                  "--prefill", prefill, str(boot), "--decode", *decodes, *extra)
    gateway = f"http://{HOST}:{gw_port}"
    proc = stack.enter_context(running("gateway", argv, log_dir, gateway + "/readiness"))
    deadline = time.monotonic() + 60
    while ((len(worker_pids(proc.popen.pid)) < 2 or "workers serving" not in proc.log())
           and time.monotonic() < deadline):
        time.sleep(0.1)
    return gateway, gw_port, proc


def generate(gateway: str, tokens: int) -> int | str:
    """The status of one /generate, or how its connection ended (a killed worker's)."""
    try:
        with httpx.Client(timeout=60) as client:
            return client.post(gateway + "/generate", json={
                "text": f"{os.urandom(4).hex()} crash",
                "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}}).status_code
    except httpx.TransportError as exc:
        return type(exc).__name__


def holder_of(port: int, client_port: int, pids: list[int]) -> int:
    """The worker whose accepted connection comes from `client_port`."""
    for pid in pids:
        for conn in psutil.Process(pid).net_connections():
            if conn.laddr and conn.laddr.port == port and conn.raddr \
                    and conn.raddr.port == client_port:
                return pid
    raise AssertionError(f"no worker holds the connection from port {client_port}")


def clients_of(pid: int, port: int) -> int:
    return sum(1 for conn in psutil.Process(pid).net_connections()
               if conn.laddr and conn.laddr.port == port and conn.status == "ESTABLISHED")


@pytest.mark.parametrize("victim", ["slot_holder", "waiters_only"])
def test_a_worker_killed_at_the_limit_leaves_the_others_queue_served(cluster, victim):
    gateway, port, proc = cluster["gateway"], cluster["port"], cluster["proc"]
    pids = worker_pids(proc.popen.pid)
    # the slot's request, on a raw socket so that its client port names its worker
    held = socket.create_connection((HOST, port), timeout=30)
    body = orjson.dumps({"text": "the held slot", "sampling_params": {
        "max_new_tokens": 100, "ignore_eos": True}})
    held.sendall(b"POST /generate HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%s" % (len(body), body))
    time.sleep(0.5)  # admitted: it holds the only slot for 2 s
    holder = holder_of(port, held.getsockname()[1], pids)
    with concurrent.futures.ThreadPoolExecutor(QUEUED) as pool:
        queued = []
        for _ in range(QUEUED):
            queued.append(pool.submit(generate, gateway, 10))
            time.sleep(0.05)
        time.sleep(0.5)  # every one queued behind the held slot
        killed = holder if victim == "slot_holder" else next(p for p in pids if p != holder)
        assert clients_of(killed, port) >= 2, "the victim holds queued requests too"
        os.kill(killed, signal.SIGKILL)
        started = time.monotonic()
        statuses = [future.result() for future in queued]
    held.close()
    served = [s for s in statuses if s == 200]
    cut = [s for s in statuses if s != 200]
    # the killed worker's own requests lose their connection; every other one is served
    assert served, statuses
    assert all(isinstance(s, str) for s in cut), statuses
    assert time.monotonic() - started < QUEUE_TIMEOUT, statuses
    # the dead worker's legs leave the servers' in-flight figures; the limit is whole again
    deadline = time.monotonic() + 10
    while True:
        lines = [line for line in httpx.get(gateway + "/metrics").text.splitlines()
                 if line.startswith("gateway_server_in_flight_requests{")]
        if lines and all(line.endswith(" 0.0") for line in lines):
            break
        assert time.monotonic() < deadline, lines
        time.sleep(0.2)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert list(pool.map(lambda _: generate(gateway, 5), range(4))) == [200] * 4


@pytest.fixture
def fleet(tmp_path):
    """1 prefill + 3 decodes on the command line, a 4th decode running but not in it."""
    with contextlib.ExitStack() as stack:
        port, boot = free_port(), free_port()
        prefill = f"http://{HOST}:{port}"
        stack.enter_context(running("prefill", sim("prefill", port, boot), tmp_path,
                                    prefill + "/health"))
        decodes = []
        for i in range(4):
            dport = free_port()
            url = f"http://{HOST}:{dport}"
            stack.enter_context(running(f"decode{i}", sim("decode", dport), tmp_path,
                                        url + "/health"))
            decodes.append(url)
        gateway, _, proc = two_workers(stack, tmp_path, prefill, boot, decodes[:3])
        yield {"gateway": gateway, "proc": proc, "decodes": decodes}


def received(url: str) -> int:
    return httpx.get(url + "/sim/stats", timeout=5).json()["received"]


def test_workers_started_again_keep_the_admin_changes_made_before(fleet):
    """An operator removes a decode, drains one and adds one; then both workers crash. The
    workers started again serve the operator's server set, not the command line's (before:
    the removed and the drained decode got their share again, the added one none)."""
    gateway, proc, (kept, removed, drained, added) = (fleet["gateway"], fleet["proc"],
                                                      fleet["decodes"])
    with httpx.Client(timeout=10) as client:
        assert client.request("DELETE", gateway + "/admin/servers",
                              json={"url": removed}).status_code == 200
        assert client.post(gateway + "/admin/servers/drain",
                           json={"url": drained, "timeout": 0}).status_code == 200
        assert client.post(gateway + "/admin/servers",
                           json={"url": added, "role": "decode"}).status_code == 201
    before = worker_pids(proc.popen.pid)
    for pid in before:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while True:
        now = worker_pids(proc.popen.pid)
        if len(now) == 2 and not set(now) & set(before):
            break
        assert time.monotonic() < deadline, f"workers not started again: {now}"
        time.sleep(0.1)
    while True:  # every answer now comes from a worker started again
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(gateway + "/readiness", timeout=2).status_code == 200:
                break
        assert time.monotonic() < deadline, "no worker serves again"
        time.sleep(0.1)
    counts = {url: received(url) for url in (kept, removed, drained, added)}
    for i in range(40):
        with httpx.Client(timeout=20) as client:  # a new connection each: both workers
            assert client.post(gateway + "/generate", json={
                "text": f"after the crash {i}", "sampling_params": {"max_new_tokens": 2}},
            ).status_code == 200
    got = {url: received(url) - counts[url] for url in counts}
    assert got[removed] == 0 and got[drained] == 0, got
    assert got[kept] > 0 and got[added] > 0, got
    for _ in range(6):
        with httpx.Client(timeout=10) as client:
            servers = {s["url"]: s["draining"] for s in
                       client.get(gateway + "/admin/servers").json()["servers"]
                       if s["role"] == "decode"}
        assert servers == {kept: False, drained: True, added: False}, servers


def restarted(proc, gone: int, limit: float) -> tuple[int, float]:
    """The worker started in place of `gone` (the other one alive), and the seconds it took."""
    started = time.monotonic()
    while time.monotonic() - started < limit:
        now = worker_pids(proc.popen.pid)
        if len(now) == 2 and gone not in now:
            return max(now, key=lambda pid: psutil.Process(pid).create_time()), \
                time.monotonic() - started
        time.sleep(0.05)
    raise AssertionError(f"no worker started in place of {gone} within {limit}s")


def test_a_worker_in_its_restart_backoff_holds_up_neither_another_restart_nor_sigterm(cluster):
    """A worker in a crash loop waits out a growing backoff (1, 2, 4, 8 s). Meanwhile the
    other worker's death is seen and it is started again after its own 1 s, and SIGTERM
    stops the gateway at once (before: the supervisor's loop slept through the backoff, so
    both waited for it, up to 30 s: past Kubernetes' default grace period)."""
    proc = cluster["proc"]
    looping, other = worker_pids(proc.popen.pid)
    for _ in range(3):  # its backoff doubles: 1, 2, 4 s
        os.kill(looping, signal.SIGKILL)
        looping, _ = restarted(proc, looping, 10)
    os.kill(looping, signal.SIGKILL)  # now 8 s before it is started again
    time.sleep(0.5)
    os.kill(other, signal.SIGKILL)
    started = time.monotonic()
    while not [pid for pid in worker_pids(proc.popen.pid) if pid not in (looping, other)]:
        assert time.monotonic() - started < 5, "the other worker was not started again"
        time.sleep(0.05)
    stopping = time.monotonic()
    proc.popen.send_signal(signal.SIGTERM)
    assert proc.popen.wait(timeout=10) == 0
    assert time.monotonic() - stopping < 4, "SIGTERM waited for a restart backoff"


@pytest.fixture
def discovered(tmp_path):
    """A prefill and 3 decodes as pods of the fake Kubernetes API; 2 workers discovering
    them. Yields the gateway, its Proc, the fake API and the servers' URLs."""
    from tests.discovery.fakekube import ThreadedFakeKube, make_pod  # noqa: PLC0415

    with contextlib.ExitStack() as stack:
        kube = stack.enter_context(ThreadedFakeKube())
        port, boot = free_port(), free_port()
        urls = [f"http://{HOST}:{port}"]
        stack.enter_context(running("prefill", sim("prefill", port, boot), tmp_path,
                                    urls[0] + "/health"))
        pods = [make_pod("p0", role="prefill", ip=HOST, annotations={
            "sglang.ai/port": str(port), "sglang.ai/bootstrap-port": str(boot)})]
        for i in range(3):
            dport = free_port()
            urls.append(f"http://{HOST}:{dport}")
            stack.enter_context(running(f"decode{i}", sim("decode", dport), tmp_path,
                                        urls[-1] + "/health"))
            pods.append(make_pod(f"d{i}", role="decode", ip=HOST,
                                 annotations={"sglang.ai/port": str(dport)}))
        for pod in pods:
            kube.call(kube.fake.add, pod)
        gw_port = free_port()
        gateway = f"http://{HOST}:{gw_port}"
        proc = stack.enter_context(running("gateway", python(
            "-m", "gateway", "--host", HOST, "--port", str(gw_port), "--workers", "2",
            "--k8s-api-server", kube.url, "--namespace", "default",
            "--prefill-selector", "app=sglang,role=prefill",
            "--decode-selector", "app=sglang,role=decode"), tmp_path, None))
        deadline = time.monotonic() + 60
        while "workers serving" not in proc.log() or len(listed(gateway)) < 4:
            assert time.monotonic() < deadline, "the gateway did not discover the pods"
            time.sleep(0.1)
        yield {"gateway": gateway, "proc": proc, "kube": kube, "urls": urls}


def listed(gateway: str) -> dict[str, bool]:
    """URL -> draining, as the worker answering this new connection has it."""
    with contextlib.suppress(httpx.TransportError), httpx.Client(timeout=5) as client:
        return {s["url"]: s["draining"]
                for s in client.get(gateway + "/admin/servers").json()["servers"]}
    return {}


def test_workers_started_again_during_an_api_outage_serve_the_discovered_servers(discovered):
    """The Kubernetes API goes down, a pod is deleted meanwhile, and both workers crash one
    after the other: the workers started again serve what the others had discovered (with
    the operator's drain) until the API answers, then drop the deleted pod. Before, a worker
    started again served no server until its first LIST (503 "no usable prefill and decode
    server" for every request it took, readiness 503)."""
    gateway, proc, kube = discovered["gateway"], discovered["proc"], discovered["kube"]
    prefill, kept, deleted, drained = discovered["urls"]
    with httpx.Client(timeout=10) as client:
        assert client.post(gateway + "/admin/servers/drain",
                           json={"url": drained, "timeout": 0}).status_code == 200
    kube.call(kube.fake.fail_next, "LIST", 503, 100_000)  # the API is down from here
    kube.call(kube.fake.fail_next, "WATCH", 503, 100_000)
    kube.call(kube.fake.close_watches)
    kube.call(kube.fake.delete, "d1")
    for gone in worker_pids(proc.popen.pid):  # one after the other: a sibling serves
        os.kill(gone, signal.SIGKILL)
        restarted(proc, gone, 30)
    deadline = time.monotonic() + 30
    while True:  # every answer now comes from a worker started again
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(gateway + "/readiness", timeout=2).status_code == 200:
                break
        assert time.monotonic() < deadline, "no worker started again serves"
        time.sleep(0.1)
    everything = {prefill: False, kept: False, deleted: False, drained: True}
    for _ in range(8):  # a new connection each: both workers
        assert listed(gateway) == everything
    for i in range(8):
        with httpx.Client(timeout=20) as client:
            assert client.post(gateway + "/generate", json={
                "text": f"during the outage {i}", "sampling_params": {"max_new_tokens": 2}},
            ).status_code == 200
    kube.call(kube.fake.failures.clear)  # the API answers: the deleted pod leaves
    while any(listed(gateway) != {prefill: False, kept: False, drained: True}
              for _ in range(6)):
        assert time.monotonic() < deadline + 30, listed(gateway)
        time.sleep(0.2)
