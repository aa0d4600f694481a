"""One admin add per server URL across the workers, decided by the hub
(gateway/processes/claims.py, `Siblings.claimed`). Before, each worker decided alone: two adds
of one URL through two workers both registered it, with different bootstrap ports. The rule
on its own, then through real socket pairs with one event loop playing the hub and workers."""

from __future__ import annotations

import asyncio
import socket

import pytest

from gateway.errors import GatewayError, ServiceUnavailable
from gateway.processes import siblings as siblings_module
from gateway.processes.claims import Claims
from gateway.processes.control_channel import Control, Hub
from gateway.processes.siblings import Siblings
from tests.unit.processes.test_control_channel import Worker, admin, settle

URL = "http://10.0.0.9:30000"


def claim(token: object = 1) -> dict:
    return {"kind": "claim", "url": URL, "token": token}


def release(token: object = 1) -> dict:
    return {"kind": "release", "url": URL, "token": token}


def test_the_first_claim_wins_until_its_add_is_removed():
    claims = Claims()
    assert claims.answer(0, claim())["claimed"] is True
    assert claims.answer(1, claim())["claimed"] is False  # another worker's add at once
    assert claims.answer(0, claim(2))["claimed"] is False  # or the same worker's
    claims.told(0, admin("add", URL, role="prefill", bootstrap_port=1))
    assert claims.pending == {} and claims.members == {URL}
    assert claims.answer(1, claim())["claimed"] is False  # added: already registered
    claims.told(1, admin("drain", URL))
    assert claims.answer(1, claim())["claimed"] is False
    claims.told(1, admin("remove", URL))  # removed through any worker: free again
    assert claims.answer(1, claim())["claimed"] is True


def test_a_claim_is_given_back_only_by_its_holder_or_its_holders_exit():
    claims = Claims()
    claims.answer(0, claim(7))
    claims.answer(1, release(7))  # not the holder
    claims.answer(0, release(8))  # the holder's earlier claim, long spent
    assert claims.answer(1, claim())["claimed"] is False
    claims.answer(0, release(7))  # its registration failed
    assert claims.answer(1, claim(3))["claimed"] is True
    claims.forget_worker(0)  # another worker's exit leaves it
    assert claims.answer(0, claim())["claimed"] is False
    claims.forget_worker(1)  # the holder died before it added the server
    assert claims.answer(0, claim())["claimed"] is True
    claims.told(0, admin("add", URL, role="decode"))
    claims.forget_worker(0)  # an added server stays a member
    assert claims.answer(1, claim())["claimed"] is False


def test_an_add_told_without_a_claim_holds_the_url():
    """A role switch registers the server again in its new role (a remove, then an add)."""
    claims = Claims()
    claims.told(2, admin("remove", URL))
    assert URL not in claims.members
    claims.told(2, admin("add", URL, role="decode"))
    assert claims.answer(0, claim())["claimed"] is False
    claims.answer(0, {"kind": "claim", "url": None})  # nonsense is refused, not kept
    assert claims.pending == {}


class Registers:
    """A worker's `register` as an admin add calls it: the bootstrap ports it registered."""

    def __init__(self, delay: float = 0.02) -> None:
        self.ports: list[int | None] = []
        self.delay = delay

    async def __call__(self, url: str, role: str, port: int | None, **_) -> None:
        await asyncio.sleep(self.delay)  # the probe
        self.ports.append(port)


async def add(siblings: Siblings, register: Registers, port: int) -> int:
    """What `routes/admin.add_server` does once its checks passed: the caller's status."""
    try:
        async with siblings.claimed(URL):
            await register(URL, "prefill", port)
            siblings.admin_change("add", URL, role="prefill", bootstrap_port=port, model=None)
    except GatewayError as exc:
        return exc.status
    return 201


def test_two_workers_adding_one_url_at_once_add_it_once_and_the_replay_has_the_winner():
    async def main():
        hub = Hub()
        workers = [Worker(0), Worker(1)]
        for worker in workers:
            await worker.join(hub)
        registers = [Registers(), Registers()]
        siblings = [Siblings(w.control, None, r, None, None, None)
                    for w, r in zip(workers, registers, strict=True)]
        for w in workers:  # Siblings took over the "admin" handler: the test's back
            w.control.on("admin", w._apply)
        for round_ in range(3):
            for r in registers:
                r.ports.clear()
            ports = [9000 + round_, 9100 + round_]  # each caller its own bootstrap port
            codes = await asyncio.gather(add(siblings[0], registers[0], ports[0]),
                                         add(siblings[1], registers[1], ports[1]))
            assert sorted(codes) == [201, 409], codes
            winner = codes.index(201)
            assert registers[0].ports + registers[1].ports == [ports[winner]]  # added once
            await settle(lambda w=workers[1 - winner]: ("add", URL) in w.applied)
            assert hub.replay()[-1]["bootstrap_port"] == ports[winner]  # (told via the hub)
            workers[1 - winner].applied.clear()
            siblings[1 - winner].admin_change("remove", URL)  # through the other worker
            await settle(lambda: URL not in hub.claims.members)
        for w in workers:
            await w.control.stop()

    asyncio.run(main())


def test_a_failed_registration_gives_the_url_back():
    async def main():
        hub = Hub()
        worker, other = Worker(0), Worker(1)
        await worker.join(hub)
        await other.join(hub)
        siblings = Siblings(worker.control, None, None, None, None, None)
        with pytest.raises(GatewayError):
            async with siblings.claimed(URL):
                raise GatewayError("did not answer as an SGLang prefill server", status=400)
        theirs = Siblings(other.control, None, None, None, None, None)
        async with theirs.claimed(URL):  # granted: the first claim was given back
            pass
        for w in (worker, other):
            await w.control.stop()

    asyncio.run(main())


def test_a_hub_that_does_not_answer_is_a_503_in_bounded_time(monkeypatch):
    monkeypatch.setattr(siblings_module, "CLAIM_TIMEOUT", 0.1)

    async def main():
        hub_end, theirs = socket.socketpair()  # nobody answers on the hub's end
        control = Control(theirs, 1, 2)
        await control.start()
        siblings = Siblings(control, None, None, None, None, None)
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(ServiceUnavailable) as caught:
            async with siblings.claimed(URL):
                raise AssertionError("registered without the hub's word")
        assert loop.time() - started < 1.0
        assert caught.value.status == 503 and "did not answer" in str(caught.value)
        hub_end.setblocking(False)
        await asyncio.sleep(0.05)
        sent = hub_end.recv(65536).splitlines()  # the claim, then its release (in case the
        assert [b'"claim"' in sent[0], b'"release"' in sent[1]] == [True, True]  # hub was
        await control.stop()  # only slow)
        hub_end.close()

    asyncio.run(main())


def test_without_workers_an_add_asks_nobody():
    async def main():
        async with Siblings(None, None, None, None, None, None).claimed(URL):
            pass
        async with Siblings(None, None, None, None, None, None).claimed(URL):
            pass  # nothing held: the pool's own check answers a second add

    asyncio.run(main())
