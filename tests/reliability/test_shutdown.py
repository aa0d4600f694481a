"""SIGTERM to a gateway that launched its own servers (`--launch`), with streams in flight.

Expected: the listening socket closes at once (new connections are refused), streams in
flight run to [DONE], the process exits when they are done and at the latest after
--shutdown-grace, and the servers it launched are stopped with it.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.procs import HOST, Proc, free_port, python
from tests.rigs.faults import wait_until
from tests.rigs.load import Stream

STREAMS = 6
TOKEN_DELAY = 0.05


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == pid:
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture
def launched(tmp_path):
    """Start `python -m gateway --launch` with a topology of slow-token sims."""
    procs = []

    def start(grace: float, workers: int = 1) -> tuple[Proc, str]:
        topology = tmp_path / "topology.yaml"
        topology.write_text(
            f"backend: sim\nprefill: 1\ndecode: 1\nlog_dir: {tmp_path}/servers\n"
            f"defaults:\n  all:\n    args: [--token-delay, '{TOKEN_DELAY}']\n")
        port = free_port()
        proc = Proc("gateway", python("-m", "gateway", "--launch", "--launch-config",
                                      str(topology), "--host", HOST, "--port", str(port),
                                      "--shutdown-grace", str(grace),
                                      "--workers", str(workers)), tmp_path)
        procs.append(proc)
        url = f"http://{HOST}:{port}"
        proc.wait_http(url + "/readiness", 60)
        return proc, url

    yield start
    for proc in procs:
        proc.stop()


def sigterm_during_streams(proc: Proc, url: str, tokens: int):
    servers = [pid for pid in children(proc.popen.pid)
               if b"backends.sim" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(servers) == 2, f"the launched servers: {servers}"
    streams = [Stream(url, n, tokens) for n in range(STREAMS)]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.started.wait(20), "a stream never started"
    signalled = time.monotonic()
    os.kill(proc.popen.pid, signal.SIGTERM)

    unanswered: list[Exception] = []

    def refused() -> bool:
        """A new connection is refused, or served: never queued and left unanswered."""
        try:
            httpx.get(url + "/health", timeout=1)
        except httpx.ConnectError:
            return True
        except httpx.HTTPError as exc:  # a timeout or a reset
            unanswered.append(exc)
        return False

    closed = wait_until(refused, 5, "new connections are refused after SIGTERM")
    assert not unanswered, unanswered
    return servers, streams, signalled, closed


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [1, 2])
def test_sigterm_lets_streams_finish(launched, timing, workers):
    """With --workers the supervisor's copy of the socket kept the port open: a new client
    was queued, never answered, and reset when the last stream ended."""
    grace = 10.0
    proc, url = launched(grace, workers)
    tokens = 40  # 2 s of streaming
    servers, streams, signalled, closed = sigterm_during_streams(proc, url, tokens)
    code = proc.popen.wait(grace + 10)
    exited = time.monotonic() - signalled
    for stream in streams:
        stream.join(10)
    assert [s.outcome.kind for s in streams] == ["ok"] * STREAMS, [s.outcome for s in streams]
    assert code in (0, -signal.SIGTERM), code  # uvicorn re-raises the signal it handled
    assert exited < grace, "exit waited for the grace period, not for the streams"
    assert not [pid for pid in servers if alive(pid)], "a launched server outlived the gateway"
    timing(f"SIGTERM with streams in flight, {workers} worker(s)", "listener closed after",
           closed)
    timing(f"SIGTERM with streams in flight, {workers} worker(s)", "process exited after",
           exited)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [1, 2])
def test_a_client_connected_before_sigterm_is_answered(launched, workers):
    """A client connects, the gateway gets SIGTERM, the client's request arrives: uvicorn
    closed every connection without a request in progress, so it got no answer at all
    ("Server disconnected without sending a response"). It is served, with Connection:
    close."""
    proc, url = launched(10.0, workers)
    client = socket.create_connection((HOST, int(url.rsplit(":", 1)[1])), timeout=10)
    time.sleep(0.2)  # accepted
    os.kill(proc.popen.pid, signal.SIGTERM)
    time.sleep(0.2)  # the workers began their shutdown (within FIRST_REQUEST_WAIT)
    body = b'{"model": "sim-model", "prompt": "just in", "max_tokens": 2}'
    client.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: "
                   b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
    answer = b""
    while chunk := client.recv(65536):  # the gateway closes the connection after it
        answer += chunk
    client.close()
    head = answer.split(b"\r\n\r\n", 1)[0].lower()
    assert head.startswith(b"http/1.1 200"), answer[:300]
    assert b"connection: close" in head
    proc.popen.wait(20)


@pytest.mark.timeout(60)
def test_streams_outliving_the_grace_end_with_an_error_event(launched, timing):
    grace = 1.0
    proc, url = launched(grace)
    servers, streams, signalled, _ = sigterm_during_streams(proc, url, 200)  # 10 s each
    proc.popen.wait(grace + 10)
    exited = time.monotonic() - signalled
    for stream in streams:
        stream.join(10)
    timing("SIGTERM, streams longer than the grace", "process exited after", exited)
    assert exited < grace + 3
    assert not [pid for pid in servers if alive(pid)], "a launched server outlived the gateway"
    assert all(s.outcome.kind == "stream_error" for s in streams), [s.outcome for s in streams]


def descendants(pid: int) -> list[int]:
    found, frontier = [], [pid]
    while frontier:
        kids = children(frontier.pop())
        found += kids
        frontier += kids
    return found


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [1, 2])
def test_sigterm_while_the_launched_servers_start_stops_everything_at_once(tmp_path, workers):
    """A launched decode takes a minute to start (SGLang loading a model); the operator
    changes their mind. Until the gateway can answer, its port refuses connections (before:
    they were accepted and never answered); SIGTERM stops the start, the servers and the
    gateway within seconds (before: it waited for the servers to be ready, up to the
    launcher's 300 s)."""
    topology = tmp_path / "topology.yaml"
    topology.write_text(f"backend: sim\nprefill: 1\nlog_dir: {tmp_path}/servers\n"
                        "decode:\n  - {}\n  - args: ['--slow-start', '60']\n")
    port = free_port()
    proc = Proc("gateway", python("-m", "gateway", "--launch", "--launch-config", str(topology),
                                  "--host", HOST, "--port", str(port),
                                  "--workers", str(workers)), tmp_path)
    try:
        wait_until(lambda: "decode-1 starting" in proc.log(), 30, "the slow decode starting")
        launched = [pid for pid in descendants(proc.popen.pid)
                    if b"backends.sim" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(launched) == 3, launched
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://{HOST}:{port}/readiness", timeout=2)
        signalled = time.monotonic()
        os.kill(proc.popen.pid, signal.SIGTERM)
        proc.popen.wait(20)
        assert time.monotonic() - signalled < 5
        assert not [pid for pid in launched if alive(pid)], "a launched server outlived it"
    finally:
        proc.stop()


@pytest.mark.timeout(60)
def test_workers_stop_when_their_supervisor_is_killed(tmp_path):
    """SIGKILL of the supervisor of `--workers 2 --launch`: its workers stop with it (they
    used to stay, holding the port and answering 503 for servers that were gone, and the
    next start on that port failed)."""
    port = free_port()
    proc = Proc("gateway", python("-m", "gateway", "--launch", "--host", HOST, "--port",
                                  str(port), "--workers", "2"), tmp_path)
    try:
        proc.wait_http(f"http://{HOST}:{port}/readiness", 60)
        below = descendants(proc.popen.pid)
        workers = [pid for pid in below
                   if b"worker_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(workers) == 2, workers
        os.kill(proc.popen.pid, signal.SIGKILL)
        wait_until(lambda: not [pid for pid in below if alive(pid)], 15,
                   "every worker and launched server stopped")
        again = Proc("gateway-again", python("-m", "gateway", "--launch", "--host", HOST,
                                              "--port", str(port), "--workers", "2"), tmp_path)
        try:
            again.wait_http(f"http://{HOST}:{port}/readiness", 60)
        finally:
            again.stop()
    finally:
        proc.stop()


@pytest.mark.timeout(60)
def test_a_request_cut_by_the_grace_before_its_answer_began_gets_a_json_503(launched):
    """A decode hangs (SIGSTOP) under requests; SIGTERM; the grace ends before their answers
    began: each gets a JSON 503 saying why (before: uvicorn's plain-text 500), and the
    stopped server does not hold the exit for the launcher's 15 s kill grace."""
    grace = 1.0
    proc, url = launched(grace)
    servers = children(proc.popen.pid)
    decode = next(pid for pid in servers if b"decode" in Path(f"/proc/{pid}/cmdline").read_bytes())
    os.kill(decode, signal.SIGSTOP)
    answers: list = []

    def ask() -> None:
        answers.append(httpx.post(url + "/v1/completions", timeout=30, json={
            "model": "sim-model", "prompt": "hold on", "max_tokens": 4}))
    threads = [threading.Thread(target=ask) for _ in range(3)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)  # their prefills answered; the decode legs wait on the stopped server
    signalled = time.monotonic()
    os.kill(proc.popen.pid, signal.SIGTERM)
    for thread in threads:
        thread.join(20)
    proc.popen.wait(20)
    assert time.monotonic() - signalled < grace + 5
    assert [a.status_code for a in answers] == [503] * 3, [a.text for a in answers]
    for answer in answers:
        error = answer.json()["error"]
        assert error["type"] == "service_unavailable" and "shutting down" in error["message"]
    assert not [pid for pid in servers if alive(pid)], "a launched server outlived the gateway"
