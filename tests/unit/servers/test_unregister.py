"""A server taken out of the pool takes what was learned of it along (runtime.unregister).

Added again under the same URL (a role switch, an admin remove and add, a pod replaced at the
same address), it is another process or another role: the pair quarantines and the hang
deadlines learned of the old one must not steer requests to or away from the new one."""

from __future__ import annotations

from tests.unit.fakes import FakeCluster, FakeServer, run
from tests.unit.fakes import served_gateway as gateway

P1, P2 = "http://127.0.0.1:30000", "http://127.0.0.1:30002"
D1, D2 = "http://127.0.0.1:30001", "http://127.0.0.1:30003"


def test_a_removed_server_leaves_its_learned_deadlines_and_pair_quarantines_behind():
    cluster = FakeCluster({P1: FakeServer("prefill"), P2: FakeServer("prefill"),
                           D1: FakeServer("decode"), D2: FakeServer("decode")})

    async def go():
        async with gateway(cluster) as (client, gw):
            for i in range(24):  # round robin: each prefill learns its first progress
                r = await client.post("/generate", json={"text": f"hello {i}"})
                assert r.status_code == 200, r.text
            learned = gw.learned_latency(P1)["first_progress_p"]
            assert learned, "the deadline model learned nothing of P1"
            pairs = gw.scheduler.pairs  # (P1, D1) fails while P1 works with D2
            pairs.record_success(P1, D2)
            for _ in range(pairs.threshold):
                assert pairs.record_failure(P1, D1)
            assert [(p["prefill"], p["decode"]) for p in pairs.snapshot()] == [(P1, D1)]
            assert pairs.blocked(P1, D1)

            assert gw.unregister(P1) is not None
            assert gw.learned_latency(P1) == {"first_progress_p": {}, "gap_p": None}
            assert pairs.snapshot() == [] and not pairs.blocked(P1, D1)
            assert gw.learned_latency(P2)["first_progress_p"], "the others keep theirs"

    run(go())
