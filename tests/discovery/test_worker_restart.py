"""A worker of `--workers N` started again while the Kubernetes API is down starts from the
servers its siblings' discovery has (replayed by the supervisor as `Control.found`), and
reconciles them with the pods once the API answers (gateway/discovery/kubernetes.py). Before,
it served no discovered server until its first LIST. FakeKube on loopback, the fake pool."""

from __future__ import annotations

import dataclasses

from gateway.discovery.pods import Target
from tests.discovery.fakekube import FakeKube, make_pod
from tests.discovery.harness import discovering, eventually, run, url

PREFILL, DECODE, GONE = url("10.0.0.1"), url("10.0.1.1"), url("10.0.1.2")


@dataclasses.dataclass
class FakeControl:
    """A worker's `Control` as discovery uses it: the replay, and what it tells the hub."""

    found: dict[str, dict]
    told: list[dict] = dataclasses.field(default_factory=list)

    def tell_found(self, server: dict) -> None:
        self.told.append(server)


def replayed(target: Target, draining: bool = False) -> dict:
    return {"op": "add", **dataclasses.asdict(target), "draining": draining}


def test_a_worker_started_during_an_outage_serves_what_its_siblings_found_until_the_api_answers():
    prefill = Target(PREFILL, "prefill", 8998, None, "p0", "uid-p0")
    decode = Target(DECODE, "decode", None, None, "d0", "uid-d0")
    gone = Target(GONE, "decode", None, None, "d1", "uid-d1")  # deleted during the outage
    control = FakeControl({t.url: replayed(t, draining=t is decode)
                           for t in (prefill, decode, gone)})
    fake = FakeKube()
    fake.fail_next("LIST", 503, 1000)  # the API is down when the worker starts

    async def go():
        fake.add(make_pod("p0", role="prefill", ip="10.0.0.1",
                          annotations={"sglang.ai/bootstrap-port": "8998"}))
        fake.add(make_pod("d0", role="decode", ip="10.0.1.1"))
        async with discovering(fake=fake, sync=False, control=control,
                               drain_timeout=30) as (fake_, pool, discovery):
            # start() returned: the siblings' servers are in, before any LIST answered
            assert pool.urls() == {PREFILL, DECODE, GONE}
            assert pool.servers[PREFILL].bootstrap_port == 8998
            assert pool.servers[DECODE].draining is True  # the operator's drain too
            assert set(discovery.members) == {PREFILL, DECODE, GONE}
            await eventually(lambda: len(fake.requests("LIST")) >= 3, what="LISTs refused")
            assert pool.removed == []  # the outage takes nothing out
            fake.failures.clear()  # the API answers
            await eventually(lambda: GONE not in pool.servers, what="the gone pod removed")
            assert pool.urls() == {PREFILL, DECODE}
            assert len(pool.added) == 3  # the others kept as they were, not added again
            assert pool.servers[DECODE].draining is True
            assert {"op": "remove", "url": GONE} in control.told

    run(go())
