"""A rescue (a server marked down, or its breaker opened) stops the attempts waiting on the
server only when another usable server of its role and model can take their retries; the
only server of its role keeps them (gateway/dispatch/rescue.py `rescue`)."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from gateway.dispatch import rescue
from gateway.servers.pool import Server
from tests.unit.fakes import FakeCluster, FakeServer, run, served_gateway

P1 = "http://127.0.0.1:30000"
D1, D2 = "http://127.0.0.1:30001", "http://127.0.0.1:30003"


class Waiting:
    """An attempt waiting on a server: only what a rescue touches (its interrupt)."""

    def __init__(self, interrupt) -> None:
        self.interrupt = interrupt


def server(url: str, role: str = "decode", model: str | None = "m") -> Server:
    return Server(url, role, model=model, verified=True)


def mark_down(server: Server) -> None:
    server.healthy = False


def open_breaker(server: Server) -> None:
    for _ in range(server.breaker.failure_threshold):
        server.breaker.record(False)
    assert not server.breaker.admits


async def rescued(victim: Server, peers: list[Server] | None, count: int = 2) -> tuple[int, int]:
    """(stopped, still waiting) of `count` attempts waiting on `victim` after a rescue."""
    from gateway.cancel import Interrupt  # noqa: PLC0415 - needs a running loop's tasks

    tasks = []
    for _ in range(count):
        task = asyncio.get_running_loop().create_task(asyncio.Event().wait())
        victim.attempts.add(Waiting(Interrupt(task)))
        tasks.append(task)
    await asyncio.sleep(0)
    stopped = rescue.rescue(victim, "test rescue", peers)
    await asyncio.sleep(0)
    waiting = sum(not t.done() for t in tasks)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return stopped, waiting


@pytest.mark.parametrize("fault", [mark_down, open_breaker], ids=["marked-down", "breaker"])
def test_with_another_usable_decode_the_waiting_attempts_are_stopped(fault):
    victim, other = server(D1), server(D2)
    fault(victim)
    assert run(rescued(victim, [victim, other])) == (2, 0)


@pytest.mark.parametrize("fault", [mark_down, open_breaker], ids=["marked-down", "breaker"])
def test_the_only_decode_keeps_its_waiting_attempts(fault):
    victim = server(D1)
    fault(victim)
    assert run(rescued(victim, [victim])) == (0, 2)


def suspected(server: Server) -> None:
    open_breaker(server)
    server.suspect_until = time.monotonic() + 60


@pytest.mark.parametrize("unusable", [mark_down, suspected,
                                      lambda w: setattr(w, "draining", True)],
                         ids=["down", "breaker-open-and-suspect", "draining"])
def test_another_decode_that_is_not_usable_does_not_count(unusable):
    victim, other = server(D1), server(D2)
    mark_down(victim)
    unusable(other)
    assert run(rescued(victim, [victim, other])) == (0, 2)


def test_a_recovering_decode_counts_when_its_health_checks_pass():
    """Breaker still open from earlier failures, health checks passing, no suspect: the
    scheduler sends a retry there rather than back to a hung server, so a rescue may too."""
    victim, recovering = server(D1), server(D2)
    mark_down(victim)
    open_breaker(recovering)
    assert run(rescued(victim, [victim, recovering])) == (2, 0)


def test_a_usable_server_of_another_role_or_model_does_not_count():
    victim = server(D1)
    mark_down(victim)
    peers = [victim, server(D2, model="other"), server(P1, role="prefill")]
    assert run(rescued(victim, peers)) == (0, 2)


def test_peers_not_known_stop_all_as_before():
    victim = server(D1)
    mark_down(victim)
    assert run(rescued(victim, None)) == (2, 0)


def test_each_rescue_logs_its_decision(caplog):
    victim, other = server(D1), server(D2)
    mark_down(victim)
    with caplog.at_level(logging.INFO, logger="gateway.dispatch.rescue"):
        run(rescued(victim, [victim]))
        run(rescued(victim, [victim, other]))
    lines = [r.getMessage() for r in caplog.records if r.name == "gateway.dispatch.rescue"]
    assert len(lines) == 2, lines
    assert "2 attempt(s) keep waiting" in lines[0] and "no other usable decode" in lines[0]
    assert "2 attempt(s) stopped" in lines[1]


class Hung(Waiting):
    """The attempt whose stream got no first chunk after its KV arrived."""

    def __init__(self, decode: Server) -> None:
        super().__init__(None)
        self.decode = decode


async def hung_stops(decode: Server, peers: list[Server] | None) -> tuple[int, int]:
    """(stopped, still waiting) of two other attempts on `decode` after `decode_hung`."""
    from gateway.cancel import Interrupt  # noqa: PLC0415 - needs a running loop's tasks

    tasks = []
    for _ in range(2):
        task = asyncio.get_running_loop().create_task(asyncio.Event().wait())
        decode.attempts.add(Waiting(Interrupt(task)))
        tasks.append(task)
    await asyncio.sleep(0)
    rescue.decode_hung(Hung(decode), 10.0, peers)
    await asyncio.sleep(0)
    waiting = sum(not t.done() for t in tasks)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return 2 - waiting, waiting


def test_a_hung_decode_stops_the_others_only_where_a_retry_can_go():
    """`decode_hung` makes the decode a suspect either way; it stops the other attempts on
    it only when another usable decode can take their retries."""
    alone = server(D1)
    assert run(hung_stops(alone, [alone])) == (0, 2)
    assert alone.suspect_until > 0
    hung, other = server(D1), server(D2)
    assert run(hung_stops(hung, [hung, other])) == (2, 0)
    assert run(hung_stops(server(D1), None)) == (2, 0)  # peers not known: as before


# -- through the gateway (runtime wiring, dispatcher, proxy) ---------------------------------


async def _in_flight(gw, role: str = "decode") -> Server:
    """The server of `role` the request in flight waits on."""
    for _ in range(200):
        busy = [w for w in gw.pool.role(role) if w.attempts]
        if busy:
            return busy[0]
        await asyncio.sleep(0.01)
    raise AssertionError("no attempt in flight")


def _health_marks_down(gw, server: Server) -> None:
    """What the health checker does after enough failed checks (the runtime's `on_down`)."""
    for _ in range(gw.config.health_failures):
        gw.health.record(server, False)
    assert not server.healthy


def test_only_decode_marked_down_mid_request_still_answers_200():
    cluster = FakeCluster({P1: FakeServer("prefill"), D1: FakeServer("decode", delay=0.5)})

    async def go():
        async with served_gateway(cluster) as (client, gw):
            request = asyncio.ensure_future(client.post("/generate", json={"text": "x"}))
            _health_marks_down(gw, await _in_flight(gw))
            return await request

    r = run(go())
    assert r.status_code == 200, r.text
    assert cluster.servers[D1].cancelled == 0 and len(cluster.servers[D1].received) == 1


def _breaker_opens(gw, server: Server) -> None:
    """What ledger.Ledger.leg_done does when a failure opens the server's breaker."""
    open_breaker(server)
    assert gw.dispatcher.ledger.rescue(server, "opened its circuit breaker") == 1


@pytest.mark.parametrize("fault", [_health_marks_down, _breaker_opens],
                         ids=["marked-down", "breaker-open"])
def test_with_another_decode_the_waiting_request_moves_to_it(fault):
    cluster = FakeCluster({P1: FakeServer("prefill"), D1: FakeServer("decode", delay=0.5),
                           D2: FakeServer("decode", delay=0.5)})

    async def go():
        async with served_gateway(cluster) as (client, gw):
            request = asyncio.ensure_future(client.post("/generate", json={"text": "x"}))
            victim = await _in_flight(gw)
            fault(gw, victim)
            return victim.url, await request

    victim, r = run(go())
    other = D2 if victim == D1 else D1
    assert r.status_code == 200, r.text
    assert cluster.servers[victim].cancelled == 1
    assert len(cluster.servers[other].received) == 1


def test_breaker_opening_on_the_only_decode_does_not_restart_its_requests():
    """The breaker path (ledger.Ledger.leg_done): a failure opens the only decode's breaker while
    another request waits there; that request is not aborted and sent back to the same
    server (panic routing), it finishes where it was."""
    decode = FakeServer("decode", delay=1.0, fail_if=lambda body: body.get("text") == "fail")
    cluster = FakeCluster({P1: FakeServer("prefill"), D1: decode})

    async def go():
        async with served_gateway(cluster, "--breaker-failures", "1") as (client, gw):
            waiting = asyncio.ensure_future(client.post("/generate", json={"text": "x"}))
            await _in_flight(gw)
            decode.delay = 0.0  # the failing one ends while the first still waits
            failing = await client.post("/generate", json={"text": "fail"})
            assert gw.pool.get(D1).breaker.state == "open"
            return failing, await waiting

    failing, r = run(go())
    assert failing.status_code >= 500
    assert r.status_code == 200, r.text
    assert decode.cancelled == 0
    assert [b["text"] for b in decode.received].count("x") == 1, "the waiting one was resent"


def test_a_rescued_attempt_does_not_spend_the_requests_attempts():
    """With --max-attempts 1 the request still moves: a rescue is the gateway's own move,
    not a failure of the request on its servers."""
    cluster = FakeCluster({P1: FakeServer("prefill"), D1: FakeServer("decode", delay=0.5),
                           D2: FakeServer("decode", delay=0.5)})

    async def go():
        async with served_gateway(cluster, "--max-attempts", "1") as (client, gw):
            request = asyncio.ensure_future(client.post("/generate", json={"text": "x"}))
            _health_marks_down(gw, await _in_flight(gw))
            return await request

    r = run(go())
    assert r.status_code == 200, r.text
