"""POST /admin/servers/role against real gateway and simulator processes: a switch each way
under steady light load with no failed request, each SGLang refusal leaving the fleet as it
was, a switch broken midway taking the server out, never an empty role, one switch at a time
(across `--workers` too).

Every server here runs a bootstrap server (as SGLang does with `--enable-pd-role-switch`), so
each gets its own bootstrap port.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
from collections.abc import Iterator

import httpx
import pytest

from tests.procs import HOST, Proc, free_port, python
from tests.rigs.faults import FAST_DETECTION, SIM_ARGS, START_TIMEOUT, Rig, Server, wait_until
from tests.rigs.load import Load, failures, summary

pytestmark = pytest.mark.timeout(150)

FLAG = "--enable-pd-role-switch"
GATEWAY_ARGS = (*FAST_DETECTION, "--log-level", "info")


class SwitchRig(Rig):
    """The fault rig with a bootstrap port on every server (decodes too)."""

    def start(self) -> SwitchRig:
        for role, count in (("prefill", self.n_prefill), ("decode", self.n_decode)):
            for i in range(count):
                server = Server(role, free_port(), free_port(), name=f"{role}{i}")
                server.command = server.argv(*SIM_ARGS, *self.sim_args)
                self.servers.append(server)
        for server in self.servers:
            server.proc = Proc(server.name, server.command, self.log_dir)
        for server in self.servers:
            server.proc.wait_http(server.url + "/health", START_TIMEOUT)
        port = free_port()
        argv = python("-m", "gateway", "--host", HOST, "--port", str(port))
        for server in self.prefill:
            argv += ["--prefill", server.url, str(server.bootstrap_port)]
        for server in self.decode:
            argv += ["--decode", server.url]
        self.gateway = f"http://{HOST}:{port}"
        self.gateway_proc = Proc("gateway", argv + list(self.gateway_args), self.log_dir)
        self.gateway_proc.wait_http(self.gateway + "/readiness", START_TIMEOUT)
        return self

    def switch(self, server: Server, role: str, **extra) -> httpx.Response:
        return self.http.post(self.gateway + "/admin/servers/role",
                              json={"url": server.url, "role": role, **extra}, timeout=60)

    def switched(self, outcome: str) -> float:
        return self.metrics().total("gateway_role_switches_total", outcome=outcome)


@pytest.fixture
def rig(tmp_path) -> Iterator:
    """make(n_prefill, n_decode, *sim_flags, gateway_args=...) -> a started SwitchRig."""
    with contextlib.ExitStack() as stack:
        def make(n_prefill: int, n_decode: int, *sim_args: str,
                 gateway_args: tuple[str, ...] = GATEWAY_ARGS) -> SwitchRig:
            made = SwitchRig(tmp_path, gateway_args, n_prefill, n_decode, sim_args)
            stack.callback(made.close)
            return made.start()

        yield make


def as_it_was(rig: SwitchRig, server: Server, role: str) -> None:
    """The server is back in its role's rotation, nothing else changed."""
    snap = rig.snapshot(server)
    assert (snap["role"], snap["draining"], snap["misconfigured"]) == (role, False, None), snap
    wait_until(lambda: rig.usable(server), 10, f"{server.name} usable again")


def error(response: httpx.Response) -> dict:
    return response.json()["error"]


def test_switch_both_ways_under_light_load(rig, tmp_path):
    access = tmp_path / "access.log"
    rig = rig(1, 2, FLAG, gateway_args=(*GATEWAY_ARGS, "--access-log", str(access)))
    flipper = rig.decode[1]
    with Load(rig.gateway, loops=2, max_new_tokens=16) as load:
        load.wait_count(10, 0, 30)
        to_prefill = rig.switch(flipper, "prefill", deadline=30)
        assert to_prefill.status_code == 200, to_prefill.text
        snap = to_prefill.json()["server"]
        assert (snap["role"], snap["bootstrap_port"]) == ("prefill", flipper.bootstrap_port)
        assert rig.stats(flipper)["mode"] == "prefill"
        # the new prefill takes its share of the load
        wait_until(lambda: rig.snapshot(flipper)["total_requests"] >= 3, 30,
                   "requests reach the new prefill", detail=lambda: rig.snapshot(flipper))
        back = rig.switch(flipper, "decode", deadline=30)
        assert back.status_code == 200, back.text
        assert back.json()["server"]["role"] == "decode"
        wait_until(lambda: rig.snapshot(flipper)["total_requests"] >= 3, 30,
                   "requests reach it as a decode again")
        outcomes = load.stop()
    assert not failures(outcomes), summary(outcomes)
    assert len(outcomes) >= 20
    assert rig.switched("switched") == 2
    assert "is now a prefill server" in rig.gateway_proc.log()

    def switch_lines() -> list[dict]:
        lines = [json.loads(line) for line in access.read_text().splitlines()]
        return [line for line in lines if line["endpoint"] == "/admin/servers/role"]
    wait_until(lambda: len(switch_lines()) == 2, 10, "two access-log lines")
    assert [(x["status"], x["prefill"], x["decode"]) for x in switch_lines()] == [
        (200, flipper.url, None), (200, None, flipper.url)]


def test_busy_past_the_deadline_is_put_back(rig):
    """Our own requests still in flight, then a request the gateway never saw (SGLang's own
    "instance is not idle"): each leaves the server as it was, and no request fails."""
    rig = rig(2, 2, FLAG, "--token-delay", "0.1")
    decode, prefill = rig.decode[1], rig.prefill[1]
    with Load(rig.gateway, loops=4, max_new_tokens=30, timeout=30) as load:
        # each request decodes for about 3 s
        wait_until(lambda: rig.snapshot(decode)["in_flight"] > 0, 20, "requests on it")
        refused = rig.switch(decode, "prefill", deadline=0.5)
        assert refused.status_code == 409, refused.text
        assert error(refused)["code"] == "role_switch_busy"
        assert "still in flight after the 0.5s deadline" in error(refused)["message"]
        as_it_was(rig, decode, "decode")
        outcomes = load.stop()
    assert not failures(outcomes), summary(outcomes)
    assert rig.stats(decode)["mode"] == "decode"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # holds its room ~5 s, no decode
        pool.submit(httpx.post, prefill.url + "/generate", timeout=30, json={
            "text": "direct", "bootstrap_host": HOST, "bootstrap_port": prefill.bootstrap_port,
            "bootstrap_room": 7})
        wait_until(lambda: rig.stats(prefill)["in_flight"] > 0, 10, "a request the gateway "
                   "never saw", detail=lambda: rig.stats(prefill))
        refused = rig.switch(prefill, "decode", deadline=1)
    assert refused.status_code == 409, refused.text
    assert "instance is not idle; drain all requests before switching" in \
        error(refused)["message"]
    as_it_was(rig, prefill, "prefill")
    assert rig.switched("busy") == 2


def test_refusals_that_change_nothing(rig):
    """No flag on the servers: SGLang's refusal; the only prefill: the gateway's own."""
    rig = rig(1, 2)
    refused = rig.switch(rig.decode[0], "prefill")
    assert refused.status_code == 409, refused.text
    assert "--enable-pd-role-switch is not set on this server" in error(refused)["message"]
    as_it_was(rig, rig.decode[0], "decode")
    empty = rig.switch(rig.prefill[0], "decode")
    assert empty.status_code == 409 and error(empty)["code"] == "role_empty", empty.text
    as_it_was(rig, rig.prefill[0], "prefill")
    assert rig.stats(rig.prefill[0])["mode"] == "prefill"
    assert (rig.switched("refused"), rig.switched("conflict")) == (1, 1)


def test_prepare_refused_then_the_peer_figures_pass(rig):
    """A prefill becoming a decode needs graph headroom: SGLang's prepare_only refuses when
    there is too little; with room, the decode peer's figures the gateway sends suffice."""
    rig = rig(2, 1, FLAG)
    prefill = rig.prefill[1]
    rig.fault(prefill, gpu_free_gb=0.1)
    refused = rig.switch(prefill, "decode")
    assert refused.status_code == 409, refused.text
    assert ("insufficient decode CUDA graph headroom: required=0.500 GB, available=0.100 GB"
            in error(refused)["message"])
    as_it_was(rig, prefill, "prefill")
    rig.fault(prefill, gpu_free_gb=80)
    switched = rig.switch(prefill, "decode")
    assert switched.status_code == 200, switched.text
    assert rig.stats(prefill)["mode"] == "decode"


def test_a_switch_failing_midway_takes_the_server_out(rig):
    rig = rig(1, 2, FLAG)
    broken = rig.decode[1]
    rig.fault(broken, role_switch_fail=True)
    with Load(rig.gateway, loops=2) as load:
        load.wait_count(6, 0, 30)
        failed = rig.switch(broken, "prefill")
        assert failed.status_code == 502, failed.text
        assert error(failed)["code"] == "role_switch_failed"
        assert "role switch failed; instance unhealthy, restart required" in \
            error(failed)["message"]
        snap = rig.snapshot(broken)
        assert not snap["usable"] and "restart required" in snap["misconfigured"]
        seen = rig.stats(broken)["received"]
        load.wait_count(load.count() + 10, 0, 30)
        outcomes = load.stop()
    assert rig.stats(broken)["received"] == seen, "a request reached the broken server"
    assert not failures(outcomes), summary(outcomes)
    assert rig.switched("failed") == 1


def switching_a_busy_server(rig: SwitchRig, pool: concurrent.futures.Executor, held: Server,
                            room: int) -> concurrent.futures.Future:
    """A request the gateway never saw keeps `held` busy (~5 s); the switch of it to decode
    (3 s deadline) is asked and drains it: its answer (409 busy, later)."""
    pool.submit(httpx.post, held.url + "/generate", timeout=30, json={
        "text": "direct", "bootstrap_host": HOST, "bootstrap_port": held.bootstrap_port,
        "bootstrap_room": room})
    wait_until(lambda: rig.stats(held)["in_flight"] > 0, 10, "the server is busy")
    switch = pool.submit(rig.switch, held, "decode", deadline=3)
    wait_until(lambda: rig.snapshot(held)["draining"], 10, "the switch drains")
    return switch


def test_one_switch_at_a_time_across_workers(rig):
    """A switch waiting on its server holds the lock: a second one is refused at once,
    whichever worker process it reaches."""
    rig = rig(2, 2, FLAG, gateway_args=(*GATEWAY_ARGS, "--workers", "2"))
    held = rig.prefill[1]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = switching_a_busy_server(rig, pool, held, room=9)
        second = [rig.switch(rig.decode[0], "prefill") for _ in range(4)]
        assert first.result(30).status_code == 409
    for answer in second:
        assert answer.status_code == 409, answer.text
        assert error(answer)["code"] == "role_switch_in_progress", answer.text
    as_it_was(rig, held, "prefill")
    as_it_was(rig, rig.decode[0], "decode")


def test_the_operator_cannot_change_a_server_under_a_switch_from_any_worker(rig):
    """While a switch holds a server, a drain, undrain or DELETE of it is refused (409) by
    every worker: the switch would undo it (its put-back restored the drain state from before,
    its registration in the new role added a deleted server back). Once the switch ends, the
    operator's change is taken."""
    rig = rig(2, 2, FLAG, gateway_args=(*GATEWAY_ARGS, "--workers", "2"))
    held = rig.prefill[1]
    admin = rig.gateway + "/admin/servers"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        switch = switching_a_busy_server(rig, pool, held, room=11)
        refused = []
        for _ in range(3):  # a new connection each: both workers answer
            with httpx.Client(timeout=10) as client:
                refused += [client.request("DELETE", admin, json={"url": held.url}),
                            client.post(admin + "/drain", json={"url": held.url, "timeout": 0}),
                            client.post(admin + "/undrain", json={"url": held.url})]
        assert switch.result(30).status_code == 409  # busy past its deadline: put back
    for answer in refused:
        assert answer.status_code == 409, answer.text
        assert error(answer)["code"] == "role_switch_in_progress", answer.text
    as_it_was(rig, held, "prefill")
    drained = rig.http.post(admin + "/drain", json={"url": held.url, "timeout": 0})
    assert drained.status_code == 200, drained.text


def test_workers_started_again_after_a_switch_serve_the_switched_server(rig):
    """A switch, then both workers crash: the workers started again take the switched server
    in its new role (before: each found it on the command line in its old role, refused to
    start, and was started again in a loop, forever)."""
    from tests.integration.test_workers import worker_pids  # noqa: PLC0415 - one helper

    rig = rig(1, 2, FLAG, gateway_args=(*GATEWAY_ARGS, "--workers", "2"))
    moved = rig.decode[1]
    switched = rig.switch(moved, "prefill")
    assert switched.status_code == 200, switched.text
    supervisor = rig.gateway_proc.popen.pid
    before = worker_pids(supervisor)
    for pid in before:
        os.kill(pid, signal.SIGKILL)

    def serving_again() -> bool:
        now = worker_pids(supervisor)
        if len(now) != 2 or set(now) & set(before):
            return False
        with contextlib.suppress(httpx.TransportError):
            return httpx.get(rig.gateway + "/readiness", timeout=2).status_code == 200
        return False
    wait_until(serving_again, 30, "both workers serving again",
               detail=lambda: rig.gateway_proc.log()[-2000:])
    seen = rig.stats(moved)["received"]
    with Load(rig.gateway, loops=2) as load:
        load.wait_count(20, 0, 30)
        outcomes = load.stop()
    assert not failures(outcomes), summary(outcomes)
    assert rig.stats(moved)["mode"] == "prefill" and rig.stats(moved)["received"] > seen
    for _ in range(4):
        with httpx.Client(timeout=10) as client:
            roles = {s["url"]: s["role"] for s in
                     client.get(rig.gateway + "/admin/servers").json()["servers"]}
        assert roles[moved.url] == "prefill", roles
    assert rig.gateway_proc.log().count("restarting in") == 2  # the two kills, no loop
