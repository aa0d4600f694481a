"""Kept-alive client connections: the gateway does not close one a client may be reusing.

A client pool reuses an idle connection until its own expiry (httpx, and so the OpenAI SDKs:
5 s). A gateway that closed idle connections at that same age closed some as a client sent on
them: "Server disconnected without sending a response" (a flood client in the full suite,
tests/slo/test_processes.py). And after a stall of the gateway's process (stopped, or
descheduled), the keep-alive check ran before the loop read a request that had arrived
meanwhile, and closed its connection. Real processes on loopback, raw sockets (a client pool
would hide a close by opening another connection).
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import orjson
import pytest

from tests.rigs.faults import running_rig

BODY = orjson.dumps({"text": "keep me", "sampling_params": {"max_new_tokens": 2}})
REQUEST = (b"POST /generate HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
           b"content-length: %d\r\n\r\n%s" % (len(BODY), BODY))


def answer(sock: socket.socket) -> int:
    """Read one whole answer (content-length framed); its status, or 0 if the connection
    closed first."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return 0
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            return 0
        rest += chunk
    return int(head.split(b" ", 2)[1])


def connect(rig) -> socket.socket:
    host, port = rig.gateway.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=20)
    sock.sendall(REQUEST)
    assert answer(sock) == 200
    return sock


@pytest.mark.timeout(120)
def test_a_connection_idle_past_a_client_pools_expiry_is_still_served(tmp_path) -> None:
    with running_rig(tmp_path, (), n_prefill=1, n_decode=1) as rig, connect(rig) as sock:
        time.sleep(6.0)  # past httpx's 5 s, and the gateway's old 5 s keep-alive wait
        sock.sendall(REQUEST)
        assert answer(sock) == 200


PROBE = b"GET /readiness HTTP/1.1\r\nhost: gw\r\n\r\n"  # answered by the gateway itself


def hammer(rig, stop: threading.Event, served: list[int], failed: list[str]) -> None:
    """One kept-alive connection asking as fast as it is answered, until `stop`."""
    host, port = rig.gateway.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        while not stop.is_set():
            try:
                sock.sendall(PROBE)
                status = answer(sock)
            except OSError as exc:
                failed.append(repr(exc))
                return
            if status != 200:
                failed.append(f"status {status} after {len(served)} answers")
                return
            served.append(time.monotonic())


@pytest.mark.timeout(120)
def test_requests_sent_while_the_gateway_stalled_are_served(tmp_path) -> None:
    """The gateway is stopped while busy (as a descheduled process is), longer than its
    keep-alive wait; the requests its clients sent meanwhile are answered, none of their
    connections is closed."""
    args = ("--keep-alive-timeout", "0.5")
    with running_rig(tmp_path, args, n_prefill=1, n_decode=1) as rig:
        pid = rig.gateway_proc.popen.pid
        stop = threading.Event()
        served: list[list[float]] = [[] for _ in range(16)]
        failed: list[str] = []
        threads = [threading.Thread(target=hammer, args=(rig, stop, s, failed), daemon=True)
                   for s in served]
        for thread in threads:
            thread.start()
        try:
            time.sleep(1.0)
            for _ in range(10):  # each stop a chance to catch the loop mid-iteration
                os.kill(pid, signal.SIGSTOP)
                time.sleep(1.0)  # past the 0.5 s keep-alive wait
                os.kill(pid, signal.SIGCONT)
                resumed = time.monotonic()
                time.sleep(0.5)
        finally:
            os.kill(pid, signal.SIGCONT)
            stop.set()
            for thread in threads:
                thread.join(30)
        assert not failed, failed
        assert all(s and s[-1] > resumed for s in served)  # every client served after it
