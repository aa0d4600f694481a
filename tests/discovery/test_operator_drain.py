"""An operator's drain of a discovered server outlives its pod blipping unready and ready
(gateway/discovery/kubernetes.py): before, discovery removed the idle server and added the
pod afresh, undrained, or cancelled its own drain and undrained it. FakeKube on loopback,
the fake pool of tests/discovery/harness.py; `server.draining = True` is what the admin
route (and a sibling worker told of it) does."""

from __future__ import annotations

import pytest

from tests.discovery.fakekube import make_pod
from tests.discovery.harness import discovering, eventually, run, url

DECODE = url("10.0.1.1")


def pods(decode_uid: str = "uid-d0") -> list[dict]:
    return [make_pod("p0", role="prefill", ip="10.0.0.1"),
            make_pod("d0", role="decode", ip="10.0.1.1", uid=decode_uid)]


async def blip(fake, pool, discovery, *, in_flight: int = 0) -> None:
    """d0 unready, then ready again once discovery drained it (and removed it when idle)."""
    server = pool.servers[DECODE]
    server.in_flight = in_flight
    removed = len(pool.removed)
    fake.set_ready("d0", False)
    if in_flight:
        await eventually(lambda: discovery.members[DECODE].drain is not None,
                         what="discovery's drain")
    else:
        await eventually(lambda: len(pool.removed) > removed, what="the idle server removed")
    fake.set_ready("d0", True)

    def back() -> bool:
        member = discovery.members.get(DECODE)
        return member is not None and member.drain is None and DECODE in pool.servers
    await eventually(back, what="d0 back, not draining for discovery")
    server.in_flight = 0


@pytest.mark.parametrize("in_flight", [0, 1], ids=["removed-and-added-again",
                                                    "drain-cancelled-while-busy"])
def test_an_operator_drain_outlives_a_readiness_blip(in_flight):
    async def go():
        async with discovering(*pods(), drain_timeout=30) as (fake, pool, discovery):
            pool.servers[DECODE].draining = True  # POST /admin/servers/drain
            await blip(fake, pool, discovery, in_flight=in_flight)
            assert pool.servers[DECODE].draining is True

    run(go())


def test_an_undrained_server_comes_back_undrained_and_an_undrain_ends_the_hold():
    async def go():
        async with discovering(*pods(), drain_timeout=30) as (fake, pool, discovery):
            await blip(fake, pool, discovery)  # never drained by the operator
            assert pool.servers[DECODE].draining is False
            pool.servers[DECODE].draining = True  # drained, blipped: still drained
            await blip(fake, pool, discovery)
            assert pool.servers[DECODE].draining is True
            pool.servers[DECODE].draining = False  # POST /admin/servers/undrain
            await blip(fake, pool, discovery)
            assert pool.servers[DECODE].draining is False

    run(go())


def test_a_new_pod_at_the_drained_address_starts_undrained():
    """The drain was of the pod: one deleted for good ends it, a new one is a new server."""
    async def go():
        async with discovering(*pods(), drain_timeout=30) as (fake, pool, discovery):
            pool.servers[DECODE].draining = True
            await blip(fake, pool, discovery)  # the same pod: still drained
            old = pool.servers[DECODE]
            assert old.draining is True
            fake.delete("d0")
            await eventually(lambda: DECODE not in pool.servers, what="d0 removed")
            fake.add(pods(decode_uid="uid-d0-new")[1])
            await eventually(lambda: DECODE in discovery.members, what="the new pod added")
            assert pool.servers[DECODE] is not old
            assert pool.servers[DECODE].draining is False

    run(go())
