"""The retry budget under rolling faults (gateway/dispatch/proxy.py `_spends`): a quick
failure on a pair picked with no sound choice left does not spend an attempt while another
server of the failing role serves, and a role broken as a whole still fails fast."""

from __future__ import annotations

from tests.unit.fakes import FakeCluster, FakeServer, run
from tests.unit.fakes import served_client as gateway

P1 = "http://p1:1"
DECODES = ("http://d1:1", "http://d2:1", "http://d3:1")


def failing_first(times: int):
    """A decode that answers 500 to the first `times` legs of the "rolling" request."""
    seen = {"n": 0}

    def fail(body: dict) -> bool:
        if body.get("text") != "rolling":
            return False
        seen["n"] += 1
        return seen["n"] <= times

    return fail


def rolling_cluster(times: int) -> FakeCluster:
    servers = {P1: FakeServer("prefill")}
    for url in DECODES:
        servers[url] = FakeServer("decode", fail_if=failing_first(times))
    return FakeCluster(servers)


def test_rolling_faults_do_not_exhaust_the_attempts():
    """Every decode fails this request twice, each in turn, while each serves others: six
    failures, more than --max-attempts 5, yet the request is served (before: a 502 after
    the fifth), and the retries on already failed decodes waited for them."""
    cluster = rolling_cluster(times=2)

    async def go():
        args = ("--max-attempts", "5", "--retry-backoff-max", "0.05",
                "--breaker-failures", "100")
        async with gateway(cluster, *args) as client:
            for _ in DECODES:  # every decode has just served a request
                assert (await client.post("/generate", json={"text": "warm"})).status_code == 200
            return await client.post("/generate", json={"text": "rolling"})

    r = run(go())
    assert r.status_code == 200, r.text
    legs = sum(1 for url in DECODES for b in cluster.servers[url].received
               if b["text"] == "rolling")
    assert legs == 7, legs


def test_a_role_broken_as_a_whole_still_fails_after_max_attempts():
    """No decode serves anything: the doubtful retries spend attempts as before."""
    cluster = rolling_cluster(times=100)

    async def go():
        async with gateway(cluster, "--max-attempts", "5", "--breaker-failures", "100") \
                as client:
            return await client.post("/generate", json={"text": "rolling"})

    r = run(go())
    assert r.status_code == 502, r.text
    legs = sum(1 for url in DECODES for b in cluster.servers[url].received
               if b["text"] == "rolling")
    assert legs == 5, legs
