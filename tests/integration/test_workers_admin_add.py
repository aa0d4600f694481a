"""`--workers 2`: the same server added through both workers at once is added once.

Each worker applied an admin add itself and then told its sibling, which skipped the add of
a URL it already held: two adds of one prefill with different bootstrap ports, one through
each worker, could both answer 201, and the workers then kept different bootstrap ports for
it (the hub's replay whichever came last). Now the hub decides which add wins (a claim asked
of it before the worker registers, gateway/processes/claims.py): the other caller gets 409,
and both workers, and a worker started again, hold the winner's port.

Real processes on loopback: the supervisor, two workers, simulators. Each call goes to a
chosen worker: keep-alive connections are opened until both workers hold one (which worker
holds a connection is read from the kernel's socket table).
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import threading
import time

import orjson
import pytest

from tests.integration.conftest import sim
from tests.integration.test_worker_crash import holder_of, restarted, two_workers
from tests.integration.test_workers import worker_pids
from tests.procs import HOST, free_port, running

ROUNDS = 6
SETTLE = 10.0  # seconds for a told change to reach the other worker


@pytest.fixture
def fleet(tmp_path):
    """A gateway of 2 workers (1 prefill, 1 decode), and a second prefill to add."""
    with contextlib.ExitStack() as stack:
        ports = {name: free_port() for name in ("prefill", "boot", "decode", "extra", "xboot")}
        urls = {name: f"http://{HOST}:{ports[name]}" for name in ("prefill", "decode", "extra")}
        stack.enter_context(running("prefill", sim("prefill", ports["prefill"], ports["boot"]),
                                    tmp_path, urls["prefill"] + "/health"))
        stack.enter_context(running("decode", sim("decode", ports["decode"]), tmp_path,
                                    urls["decode"] + "/health"))
        stack.enter_context(running("extra", sim("prefill", ports["extra"], ports["xboot"]),
                                    tmp_path, urls["extra"] + "/health"))
        _, gw_port, proc = two_workers(stack, tmp_path, urls["prefill"], ports["boot"],
                                       [urls["decode"]])
        conns = per_worker(gw_port, worker_pids(proc.popen.pid))
        try:
            yield {"conns": conns, "extra": urls["extra"], "proc": proc, "port": gw_port}
        finally:
            for conn in conns.values():
                conn.close()


def per_worker(port: int, pids: list[int],
               timeout: float = 15.0) -> dict[int, http.client.HTTPConnection]:
    """One kept-alive connection held by each worker (pid -> connection)."""
    held: dict[int, http.client.HTTPConnection] = {}
    spare: list[http.client.HTTPConnection] = []
    deadline = time.monotonic() + timeout
    try:
        while len(held) < len(pids):
            assert time.monotonic() < deadline, f"connections reached only {sorted(held)}"
            conn = http.client.HTTPConnection(HOST, port, timeout=15)
            call(conn, "GET", "/readiness")  # accepted and answered: its worker holds it
            pid = holder_of(port, conn.sock.getsockname()[1], pids)
            if pid not in held:
                held[pid] = conn
                continue
            spare.append(conn)  # kept open: the fewest-connections accept goes elsewhere
            if len(spare) > 4:
                spare.pop(0).close()
                time.sleep(0.1)  # a worker not serving yet
    finally:
        for conn in spare:
            conn.close()
    return held


def call(conn: http.client.HTTPConnection, method: str, path: str,
         body: dict | None = None) -> tuple[int, dict]:
    data = orjson.dumps(body) if body is not None else None
    conn.request(method, path, body=data, headers={"content-type": "application/json"})
    response = conn.getresponse()
    raw = response.read()
    return response.status, orjson.loads(raw) if raw else {}


def listed(conn: http.client.HTTPConnection, url: str) -> dict | None:
    status, body = call(conn, "GET", "/admin/servers")
    assert status == 200, body
    return next((s for s in body["servers"] if s["url"] == url), None)


def at_once(conns: list[http.client.HTTPConnection], url: str,
            ports: list[int]) -> list[tuple[int, dict]]:
    """POST /admin/servers of `url` through each connection, released together."""
    barrier = threading.Barrier(len(conns))
    answers: list = [None] * len(conns)

    def add(i: int) -> None:
        barrier.wait()
        answers[i] = call(conns[i], "POST", "/admin/servers",
                          {"url": url, "role": "prefill", "bootstrap_port": ports[i]})

    threads = [threading.Thread(target=add, args=(i,)) for i in range(len(conns))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return answers


def every_worker_holds(conns, url: str, port: int | None) -> dict:
    """Each worker's bootstrap port for `url` (None: not listed) once they agree on `port`,
    or what they hold at the deadline."""
    deadline = time.monotonic() + SETTLE
    while True:
        views = {}
        for pid, conn in conns.items():
            server = listed(conn, url)
            views[pid] = None if server is None else server["bootstrap_port"]
        if set(views.values()) == {port} or time.monotonic() > deadline:
            return views
        time.sleep(0.05)


def test_one_url_added_through_both_workers_at_once_is_added_once_with_one_port(fleet):
    conns, url = fleet["conns"], fleet["extra"]
    order = list(conns)
    for round_ in range(ROUNDS):
        ports = [20000 + 2 * round_, 20001 + 2 * round_]  # a different port per caller
        answers = at_once([conns[pid] for pid in order], url, ports)
        codes = sorted(status for status, _ in answers)
        assert codes == [201, 409], (round_, answers)
        loser = next(body for status, body in answers if status == 409)
        assert "already registered" in loser["error"]["message"], loser
        won = ports[[status for status, _ in answers].index(201)]
        views = every_worker_holds(conns, url, won)
        assert set(views.values()) == {won}, (round_, won, views)
        if round_ < ROUNDS - 1:  # removed through either worker: the URL can be added again
            status, body = call(conns[order[round_ % 2]], "DELETE", "/admin/servers",
                                {"url": url})
            assert status == 200, body
            assert set(every_worker_holds(conns, url, None).values()) == {None}
        order.reverse()  # each worker's call sent first in turn
    # a worker started again gets the winner's port from the hub's replay
    proc, port = fleet["proc"], fleet["port"]
    gone = order[0]
    os.kill(gone, signal.SIGKILL)
    conns.pop(gone).close()
    successor, _ = restarted(proc, gone, 30)
    fresh = per_worker(port, worker_pids(proc.popen.pid), timeout=30)  # it serves once it
    try:  # applied the replay
        assert successor in fresh
        assert set(every_worker_holds(fresh, url, won).values()) == {won}
    finally:
        for conn in fresh.values():
            conn.close()
