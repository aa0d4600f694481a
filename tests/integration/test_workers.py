"""`--workers N`: several serving processes on one port act as one gateway.

Real processes on loopback: the supervisor, its workers, simulated servers. Checked: requests
spread over the workers and succeed; rooms stay unique across workers; metrics are summed;
admin changes reach every worker; a request held by one worker can be aborted through any;
the concurrency limit holds for the whole gateway; a killed worker is started again; SIGTERM
stops everything.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import orjson
import psutil
import pytest

from gateway.policies import create_policy
from gateway.prefix.shared import WORDS, SharedPrefixes
from gateway.request import CHAT, parse_request
from gateway.servers.load import ServerLoad
from gateway.servers.pool import Server
from gateway.servers.probe import ServerFacts
from tests.integration.conftest import sim
from tests.procs import HOST, Proc, free_port, python, running

WORKERS = 3


def children(pid: int) -> list[int]:
    out = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        ppid = next((int(line.split()[1]) for line in text.splitlines()
                     if line.startswith("PPid:")), None)
        if ppid == pid:
            out.append(int(status.parent.name))
    return out


def worker_pids(pid: int) -> list[int]:
    found = []
    for child in children(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"gateway.processes.worker_main" in cmdline:
            found.append(child)
    return found


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("logs")
    with contextlib.ExitStack() as stack:
        port, boot = free_port(), free_port()
        prefill = f"http://{HOST}:{port}"
        stack.enter_context(running("prefill", sim("prefill", port, boot, "--token-delay",
                                                   "0.02"), log_dir, prefill + "/health"))
        decodes = []
        for i in range(2):
            dport = free_port()
            url = f"http://{HOST}:{dport}"
            stack.enter_context(running(f"decode{i}", sim("decode", dport, None,
                                                          "--token-delay", "0.02"),
                                        log_dir, url + "/health"))
            decodes.append(url)
        gw_port = free_port()
        argv = python("-m", "gateway", "--host", HOST, "--port", str(gw_port),
                      "--workers", str(WORKERS), "--prefill", prefill, str(boot),
                      "--decode", *decodes, "--max-concurrency", "4", "--max-queue", "64",
                      "--loads-interval", "0.5",
                      # requests without objectives are cache_aware's (the default's) exactly;
                      # with objectives they take the joint slo path
                      "--policy", "auto")
        gateway = f"http://{HOST}:{gw_port}"
        proc = stack.enter_context(running("gateway", argv, log_dir, gateway + "/readiness"))
        deadline = time.monotonic() + 60
        while len(worker_pids(proc.popen.pid)) < WORKERS and time.monotonic() < deadline:
            time.sleep(0.1)
        while "workers serving" not in proc.log() and time.monotonic() < deadline:
            time.sleep(0.1)  # the supervisor's line once every worker accepts
        yield {"gateway": gateway, "proc": proc, "decodes": decodes, "prefill": prefill}


def generate(gateway: str, client: httpx.Client, tokens: int = 2, **extra) -> httpx.Response:
    return client.post(gateway + "/generate", json={
        "text": f"{os.urandom(4).hex()} workers", "sampling_params": {"max_new_tokens": tokens},
        **extra})


def test_every_worker_serves_and_rooms_stay_unique(cluster):
    gateway = cluster["gateway"]
    rooms, served_by = set(), set()
    for _ in range(60):
        with httpx.Client(timeout=20) as client:  # a new connection each: spread over workers
            r = generate(gateway, client)
            assert r.status_code == 200, r.text
    stats = httpx.get(cluster["prefill"] + "/sim/stats", timeout=5).json()
    numbers = [entry["room"] for entry in stats["rooms"] if entry.get("room") is not None]
    for room in numbers:
        rooms.add(room)
        served_by.add((room >> 46) & 31)  # the worker id under the replica id
    assert len(served_by) == WORKERS, served_by
    assert len(rooms) == len(numbers) >= 60


def test_a_burst_of_connections_is_spread_over_the_workers(cluster):
    """A client pool opening its keep-alive connections at once: each worker takes a share
    (one accept per wake-up, gateway/processes/fair_accept.py). uvloop's own accept loop let
    the first worker to wake take nearly all of them, and keep them."""
    port = int(cluster["gateway"].rsplit(":", 1)[1])
    count = 12 * WORKERS
    socks = [socket.create_connection((HOST, port), timeout=10) for _ in range(count)]
    try:
        for sock in socks:
            sock.sendall(b"GET /readiness HTTP/1.1\r\nHost: gateway\r\n\r\n")
        for sock in socks:  # every connection answered: every one was accepted
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = sock.recv(4096)
                assert chunk, "connection closed before its answer"
                head += chunk
            assert head.startswith(b"HTTP/1.1 200"), head[:80]
        held = {pid: sum(1 for c in psutil.Process(pid).net_connections("tcp")
                         if c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED)
                for pid in worker_pids(cluster["proc"].popen.pid)}
        assert sum(held.values()) == count, held
        assert min(held.values()) >= count // WORKERS // 2, held  # 6 of 12 each at least
    finally:
        for sock in socks:
            sock.close()


def test_metrics_are_summed_over_workers(cluster):
    gateway = cluster["gateway"]
    before = settled_total(gateway)  # earlier tests' requests published by every worker
    for _ in range(30):
        with httpx.Client(timeout=20) as client:
            assert generate(gateway, client).status_code == 200
    # each worker publishes its buffered figures every second (gateway/observability/metric_buffer.py)
    deadline = time.monotonic() + 5.0
    while (seen := total_requests(gateway) - before) < 30 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert seen == 30


def test_usage_is_summed_over_workers(cluster):
    """GET /admin/usage on any worker reads the figures every worker published."""
    gateway = cluster["gateway"]

    def usage() -> dict:
        return httpx.get(gateway + "/admin/usage", timeout=10).json()["total"]

    before = usage()
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:  # until earlier tests' figures are all published
        time.sleep(1.2)
        now = usage()
        if now == before:
            break
        before = now
    told = 0
    for _ in range(30):
        with httpx.Client(timeout=20) as client:  # a new connection each: spread over workers
            r = generate(gateway, client)
            assert r.status_code == 200
            told += r.json()["meta_info"]["completion_tokens"]
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        after = usage()
        if after["requests"] - before["requests"] >= 30 and \
                after["completion_tokens"] - before["completion_tokens"] >= told:
            break
        time.sleep(0.1)
    assert after["requests"] - before["requests"] == 30
    assert after["completion_tokens"] - before["completion_tokens"] == told > 0


def settled_total(gateway: str) -> float:
    """The request count once no worker has any left to publish (two reads 1.2 s apart,
    more than a publishing period, agree)."""
    deadline = time.monotonic() + 10.0
    last = total_requests(gateway)
    while time.monotonic() < deadline:
        time.sleep(1.2)
        now = total_requests(gateway)
        if now == last:
            return now
        last = now
    raise AssertionError("the summed request count did not settle")


def total_requests(gateway: str) -> float:
    text = httpx.get(gateway + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('gateway_requests_total{endpoint="generate",status="200"}'))


def test_admin_changes_reach_every_worker(cluster):
    gateway, decode = cluster["gateway"], cluster["decodes"][0]
    r = httpx.post(gateway + "/admin/servers/drain", json={"url": decode, "timeout": 5},
                   timeout=10)
    assert r.status_code == 200, r.text
    try:
        views = set()
        for _ in range(20):  # new connections: every worker answers some
            with httpx.Client(timeout=10) as client:
                servers = client.get(gateway + "/admin/servers").json()["servers"]
                views.add(next(s["draining"] for s in servers if s["url"] == decode))
        assert views == {True}
        received = httpx.get(decode + "/sim/stats", timeout=5).json()["received"]
        for _ in range(12):
            with httpx.Client(timeout=20) as client:
                assert generate(gateway, client).status_code == 200
        assert httpx.get(decode + "/sim/stats", timeout=5).json()["received"] == received
    finally:
        httpx.post(gateway + "/admin/servers/undrain", json={"url": decode}, timeout=10)


def test_a_request_can_be_aborted_through_any_worker(cluster):
    gateway = cluster["gateway"]
    with httpx.Client(timeout=30) as streamer:
        with streamer.stream("POST", gateway + "/generate", json={
                "text": "long one", "stream": True,
                "sampling_params": {"max_new_tokens": 400}}) as response:
            request_id = response.headers["x-request-id"]
            chunks = response.iter_raw()
            next(chunks)
            found = []
            for _ in range(WORKERS * 3):  # new connections land on the other workers too
                with httpx.Client(timeout=10) as client:
                    r = client.post(gateway + "/abort_request", json={"rid": request_id})
                    found.append(r.status_code)
                    if r.status_code == 200:
                        break
            rest = b"".join(chunks)
    assert 200 in found, found
    assert b'"abort"' in rest or b'"error"' in rest, rest[-300:]


def sim_stats(url: str) -> dict:
    return httpx.get(url + "/sim/stats", timeout=5).json()


def ended(stats: dict) -> int:
    return sum(stats[outcome] for outcome in ("completed", "failed", "cancelled", "aborted"))


def running_at_least(decodes: list[str], turn: int, unmatched: dict[str, int]) -> int:
    """A lower bound of the requests running on the decodes at one instant. The decodes are
    read one after another, so the sum of their `in_flight` can count a request that ended on
    the first read decode and its successor, started on the second: one slot, two requests
    (an alternating decode choice, `slo`'s near-tie rotation or `round_robin`, showed 5 under
    a limit of 4). Instead, read A, then B, then A again: what A had received by its first
    read and not ended by its last ran throughout, so also at B's read (`unmatched`: what each
    decode had received and never ended before the test)."""
    a, b = decodes[turn % 2], decodes[(turn + 1) % 2]
    first = sim_stats(a)
    middle = sim_stats(b)
    last = sim_stats(a)
    return first["received"] - ended(last) - unmatched[a] + middle["in_flight"]


@pytest.mark.parametrize("headers", [
    pytest.param({}, id="no_objectives"),
    pytest.param({"x-slo-ttft-ms": "60000"}, id="objectives_joint_slo_choice"),
])
def test_the_concurrency_limit_holds_for_the_whole_gateway(cluster, headers):
    gateway, decodes = cluster["gateway"], cluster["decodes"]
    unmatched = {}
    for url in decodes:
        stats = sim_stats(url)
        unmatched[url] = stats["received"] - ended(stats) - stats["in_flight"]
    peak = 0

    def one(_):
        with httpx.Client(timeout=60, headers=headers) as client:
            return generate(gateway, client, tokens=20).status_code

    def watch(stop):
        nonlocal peak
        turn = 0
        while not stop.is_set():
            peak = max(peak, running_at_least(decodes, turn, unmatched))
            turn += 1
            time.sleep(0.01)

    stop = threading.Event()
    watcher = threading.Thread(target=watch, args=(stop,), daemon=True)
    watcher.start()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        statuses = list(pool.map(one, range(16)))
    stop.set()
    watcher.join(10)
    assert statuses == [200] * 16
    assert 1 <= peak <= 4, peak  # --max-concurrency 4 over 3 workers


def test_a_killed_worker_is_started_again(cluster):
    proc = cluster["proc"]
    before = worker_pids(proc.popen.pid)
    assert len(before) == WORKERS
    os.kill(before[0], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        now = worker_pids(proc.popen.pid)
        if len(now) == WORKERS and before[0] not in now:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"no new worker: {worker_pids(proc.popen.pid)}")
    for _ in range(10):
        with httpx.Client(timeout=20) as client:
            assert generate(cluster["gateway"], client).status_code == 200


def test_sigterm_stops_every_worker(tmp_path):
    port, boot, dport, gw_port = free_port(), free_port(), free_port(), free_port()
    with running("p", sim("prefill", port, boot), tmp_path, f"http://{HOST}:{port}/health"), \
            running("d", sim("decode", dport, None), tmp_path, f"http://{HOST}:{dport}/health"):
        proc = Proc("gateway", python(
            "-m", "gateway", "--host", HOST, "--port", str(gw_port), "--workers", "2",
            "--prefill", f"http://{HOST}:{port}", str(boot),
            "--decode", f"http://{HOST}:{dport}"), tmp_path)
        proc.wait_http(f"http://{HOST}:{gw_port}/readiness", 60)
        workers = worker_pids(proc.popen.pid)
        assert len(workers) == 2
        proc.popen.send_signal(signal.SIGTERM)
        assert proc.popen.wait(30) == 0
        assert not any(Path(f"/proc/{pid}").exists() for pid in workers)


def three_prefills_one_decode(stack: contextlib.ExitStack, log_dir: Path):
    """Three prefill simulators ((url, bootstrap port) each) and one decode's url."""
    prefills = []
    for i in range(3):
        port, boot = free_port(), free_port()
        url = f"http://{HOST}:{port}"
        stack.enter_context(running(f"p{i}", sim("prefill", port, boot), log_dir,
                                    url + "/health"))
        prefills.append((url, boot))
    dport = free_port()
    decode = f"http://{HOST}:{dport}"
    stack.enter_context(running("d", sim("decode", dport, None), log_dir, decode + "/health"))
    return prefills, decode


def test_two_replicas_send_a_conversation_to_the_same_prefill(tmp_path):
    """Replicas share nothing: their consistent-hash placement agrees by construction."""
    with contextlib.ExitStack() as stack:
        prefills, decode = three_prefills_one_decode(stack, tmp_path)
        replicas = []
        for replica in range(2):
            port = free_port()
            argv = python("-m", "gateway", "--host", HOST, "--port", str(port),
                          "--replica-id", str(replica), "--decode", decode)
            for url, boot in prefills:
                argv += ["--prefill", url, str(boot)]
            url = f"http://{HOST}:{port}"
            stack.enter_context(running(f"gw{replica}", argv, tmp_path, url + "/readiness"))
            replicas.append(url)
        system = "You are the support assistant of a large retailer. " * 8
        for n in range(6):
            messages = [{"role": "system", "content": system},
                        {"role": "user", "content": f"order {n}: where is it?"}]
            homes = []
            for turn, gateway in enumerate(replicas * 2):  # alternate replicas, 4 turns
                before = {u: httpx.get(u + "/sim/stats", timeout=5).json()["received"]
                          for u, _ in prefills}
                r = httpx.post(gateway + "/v1/chat/completions", timeout=20, json={
                    "model": "sim-model", "messages": messages, "max_tokens": 4})
                assert r.status_code == 200, r.text
                after = {u: httpx.get(u + "/sim/stats", timeout=5).json()["received"]
                         for u, _ in prefills}
                homes += [u for u in after if after[u] > before[u]]
                messages = messages + [r.json()["choices"][0]["message"],
                                       {"role": "user", "content": f"and turn {turn}?"}]
            assert len(set(homes)) == 1, (n, homes)


def settle_draining(gateway: str, draining: set[str], timeout: float = 20.0) -> None:
    """Until 15 answers in a row on new connections (any worker) show exactly `draining`."""
    deadline, agreeing = time.monotonic() + timeout, 0
    while agreeing < 15:
        assert time.monotonic() < deadline, "the workers did not agree on the drained servers"
        with httpx.Client(timeout=10) as client:
            servers = client.get(gateway + "/admin/servers").json()["servers"]
        seen = {s["url"] for s in servers if s["draining"]}
        agreeing = agreeing + 1 if seen == draining else 0


def test_workers_keep_a_conversation_on_the_server_of_its_last_turn(tmp_path):
    """Turn 1 goes to the one prefill left undrained, not where the ring would place the
    conversation; turn 2, sent on new connections to whichever worker, follows it there: the
    workers that did not route turn 1 find it in the shared prefix table
    (gateway/prefix/shared.py) instead of placing the conversation afresh."""
    with contextlib.ExitStack() as stack:
        prefills, decode = three_prefills_one_decode(stack, tmp_path)
        gateways = []
        for name, workers in (("probe", 1), ("gw", WORKERS)):
            port = free_port()
            argv = python("-m", "gateway", "--host", HOST, "--port", str(port),
                          "--workers", str(workers), "--decode", decode)
            for url, boot in prefills:
                argv += ["--prefill", url, str(boot)]
            url = f"http://{HOST}:{port}"
            stack.enter_context(running(name, argv, tmp_path, url + "/readiness"))
            gateways.append(url)
        probe, gateway = gateways
        urls = [u for u, _ in prefills]

        def send(to: str, messages: list[dict]) -> tuple[str, dict]:
            before = {u: httpx.get(u + "/sim/stats", timeout=5).json()["received"] for u in urls}
            with httpx.Client(timeout=20) as client:  # a new connection: any worker
                r = client.post(to + "/v1/chat/completions", json={
                    "model": "sim-model", "messages": messages, "max_tokens": 4})
            assert r.status_code == 200, r.text
            after = {u: httpx.get(u + "/sim/stats", timeout=5).json()["received"] for u in urls}
            (went,) = [u for u in urls if after[u] > before[u]]
            return went, r.json()["choices"][0]["message"]

        turn1 = [{"role": "system", "content": "You answer for the port authority. " * 12},
                 {"role": "user", "content": "When does the ferry from the north berth?"}]
        placed, _ = send(probe, turn1)  # where every process's ring places this conversation
        home = next(u for u in urls if u != placed)
        others = {u for u in urls if u != home}
        for url in others:
            r = httpx.post(gateway + "/admin/servers/drain", json={"url": url, "timeout": 5},
                           timeout=10)
            assert r.status_code == 200, r.text
        settle_draining(gateway, others)
        went, reply = send(gateway, turn1)
        assert went == home
        for url in others:
            httpx.post(gateway + "/admin/servers/undrain", json={"url": url}, timeout=10)
        settle_draining(gateway, set())
        turn2 = [*turn1, reply, {"role": "user", "content": "And the one from the south?"}]
        homes = [send(gateway, turn2)[0] for _ in range(3 * WORKERS)]
        assert homes == [home] * len(homes), (home, placed, homes)


def test_a_snapshot_that_counts_another_workers_finished_turns_does_not_move_a_chat():
    """Two worker processes' cache_aware policies (their own servers and /v1/loads snapshots,
    one shared prefix table), in process: a conversation's turn 1, routed by worker A, ended;
    worker B's snapshot of that server was taken while A's requests ran there, and B cannot
    take A's finished requests off it. B gets turn 2 on a new connection: it must stay on the
    server of turn 1. It moved before (the ghost load made the other server "clearly
    cheaper": 24 chats x 6 turns lost 5 points of hit ratio with 2 workers, docs/WORKERS.md)."""
    table = SharedPrefixes(memoryview(bytearray(8 * WORDS)).cast("q"))
    urls = ["http://10.0.0.1:30000", "http://10.0.0.2:30000"]

    def worker():
        servers = [Server(url=url, role="prefill") for url in urls]
        for server in servers:
            server.apply_facts(ServerFacts("prefill", 8998, "sim-model", 1))
            server.load = ServerLoad(updated_at=time.monotonic())
        policy = create_policy("cache_aware", "prefill", None)
        policy.share(table)
        policy.on_servers_changed(servers)
        return policy, servers

    def view(messages):
        return parse_request(CHAT, orjson.dumps({"messages": messages, "max_tokens": 8}))

    (a, a_servers), (b, b_servers) = worker(), worker()
    turn1 = [{"role": "system", "content": "You answer for the port authority. " * 30},
             {"role": "user", "content": "When does the ferry from the north berth leave?"}]
    home = a.pick(a_servers, view(turn1))
    a.on_dispatch(home, view(turn1))
    theirs = next(s for s in b_servers if s.url == home.url)
    theirs.load = ServerLoad(running=6, updated_at=time.monotonic())  # A's, since ended
    turn2 = [*turn1, {"role": "assistant", "content": "At nine, from berth four."},
             {"role": "user", "content": "And the one from the south berth, when?"}]
    went = b.pick(b_servers, view(turn2))
    assert went.url == home.url, "worker B moved the conversation off its cache"


def test_a_port_taken_fails_the_start_leaving_nothing_behind(tmp_path):
    """The port is bound first: taken, the supervisor exits 3 before it made its shared
    block or its directory (it used to leave both, and a traceback)."""
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        before = {name for name in os.listdir("/dev/shm") if name.startswith("pdgw-")}
        done = subprocess.run(
            python("-m", "gateway", "--host", HOST, "--port", str(port), "--workers", "2",
                   "--prefill", f"http://{HOST}:1", "--decode", f"http://{HOST}:2"),
            capture_output=True, text=True, timeout=60,
            env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.returncode == 3, done.stderr
    assert "Address already in use" in done.stderr and "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == []
    assert {name for name in os.listdir("/dev/shm") if name.startswith("pdgw-")} <= before
