"""DP-rank-aware routing: a prefill with several DP ranks is scheduled rank by rank, and each
request is steered to its rank the way SGLang finds it (room % ranks, or routed_dp_rank)."""

from collections import Counter

import pytest

from gateway.servers.probe import balance_method_of, dp_ranks_of
from tests.unit.fakes import FakeCluster, FakeServer
from tests.unit.fakes import run as fakes_run
from tests.unit.fakes import served_gateway as gateway

P1, P2 = "http://127.0.0.1:30000", "http://127.0.0.1:30002"
D1 = "http://127.0.0.1:30001"


@pytest.mark.parametrize("info, ranks", [
    ({"dp_size": 4}, 4), ({"dp_size": 1, "attn_dp_size": 4, "enable_dp_attention": True}, 4),
    ({"dp_size": 2, "attn_dp_size": 1}, 2), ({}, 1), ({"dp_size": "x"}, 1),
], ids=["dp", "attention-dp-0.5.23", "dp-explicit", "none", "garbage"])
def test_dp_ranks_of_server_info(info, ranks):
    assert dp_ranks_of(info) == ranks


@pytest.mark.parametrize("info, mode, method", [
    ({"load_balance_method": "auto"}, "prefill", "follow_bootstrap_room"),
    ({}, "prefill", "follow_bootstrap_room"),
    ({"load_balance_method": "auto"}, "decode", "round_robin"),
    ({"load_balance_method": "total_tokens"}, "prefill", "total_tokens"),
], ids=["auto-prefill", "absent-prefill", "auto-decode", "explicit"])
def test_balance_method_resolves_like_sglang(info, mode, method):
    assert balance_method_of(info, mode) == method


def dp_cluster(method="follow_bootstrap_room", ranks=4, servers=(P1, P2)) -> FakeCluster:
    info = {"dp_size": ranks, "load_balance_method": method}
    return FakeCluster({**{url: FakeServer("prefill", info=info) for url in servers},
                        D1: FakeServer("decode")})


def unrelated(i: int) -> dict:
    return {"text": f"{i:04d} unrelated prompt", "sampling_params": {"max_new_tokens": 1}}


# `random` and `power_of_two` (idle servers tie) spread by chance only: not held to a share
@pytest.mark.parametrize("policy", ["round_robin", "least_load", "cache_aware", "min_ttft",
                                    "prefix_cache"])
def test_follow_room_prefills_spread_unrelated_prompts_over_every_rank(policy):
    cluster = dp_cluster()

    async def go():
        async with gateway(cluster, "--prefill-policy", policy) as (client, _):
            for i in range(160):
                assert (await client.post("/generate", json=unrelated(i))).status_code == 200

    run(go())
    for url in (P1, P2):
        rooms = [b["bootstrap_room"] for b in cluster.servers[url].received]
        share = Counter(room % 4 for room in rooms)
        assert len(share) == 4, (policy, url, share)
        assert min(share.values()) >= 0.15 * len(rooms), (policy, url, share)
    for body in cluster.servers[D1].received:  # told the prefill rank; its own rank is free
        assert "routed_dp_rank" not in body
        assert body["disagg_prefill_dp_rank"] == body["bootstrap_room"] % 4
    for url in (P1, P2):  # the prefill skips 0.5.23's broken room check with the same hint
        assert all(b["disagg_prefill_dp_rank"] == b["bootstrap_room"] % 4
                   for b in cluster.servers[url].received)


def test_other_balance_methods_get_routed_dp_rank_on_the_prefill_leg_only():
    cluster = dp_cluster(method="round_robin", servers=(P1,))

    async def go():
        async with gateway(cluster) as (client, _):
            for i in range(40):
                assert (await client.post("/generate", json=unrelated(i))).status_code == 200

    run(go())
    prefill_legs = cluster.servers[P1].received
    ranks = Counter(b["routed_dp_rank"] for b in prefill_legs)
    assert set(ranks) == {0, 1, 2, 3} and min(ranks.values()) >= 6
    assert all(b["disagg_prefill_dp_rank"] == b["routed_dp_rank"] for b in prefill_legs)
    assert all("routed_dp_rank" not in b and "disagg_prefill_dp_rank" in b
               for b in cluster.servers[D1].received)


def test_cache_aware_keeps_a_conversation_on_its_rank():
    cluster = dp_cluster(servers=(P1,))
    history = "system: you are helpful. " * 20

    async def go():
        async with gateway(cluster, "--prefill-policy", "cache_aware") as (client, gw):
            ranks = []
            for turn in range(6):
                history_turn = history + " ".join(f"turn {t}" for t in range(turn + 1))
                r = await client.post("/generate", json={"text": history_turn})
                assert r.status_code == 200
                ranks.append(cluster.servers[D1].received[-1]["bootstrap_room"] % 4)
                for i in range(3):  # unrelated traffic between the turns
                    await client.post("/generate", json=unrelated(turn * 10 + i))
            return ranks, gw.pool.get(P1).snapshot()

    ranks, snapshot = run(go())
    assert len(set(ranks)) == 1, ranks
    assert snapshot["dp_ranks"] == 4 and len(snapshot["ranks"]) == 4


def test_per_rank_loads_are_read_from_v1_loads():
    from gateway.servers.pool import Server
    from gateway.servers.probe import ServerFacts

    server = Server(P1, "prefill")
    server.apply_facts(ServerFacts("prefill", 8998, "m", 2))
    server.apply_loads({"loads": [
        {"dp_rank": 0, "num_running_reqs": 1, "num_waiting_reqs": 5, "token_usage": 0.5},
        {"dp_rank": 1, "num_running_reqs": 2, "num_waiting_reqs": 0, "token_usage": 0.1}]})
    assert [r.load.waiting for r in server.ranks] == [5, 0]
    assert server.load.running == 3 and server.load.token_usage == 0.5


@pytest.mark.parametrize("field", ["routed_dp_rank", "data_parallel_rank",
                                   "disagg_prefill_dp_rank", "bootstrap_pair_key"])
def test_client_routing_fields_are_refused_naming_the_field(field):
    cluster = dp_cluster(servers=(P1,))

    async def go():
        async with gateway(cluster) as (client, _):
            return await client.post("/generate", json={"text": "x", field: 1})

    r = run(go())
    assert r.status_code == 400 and field in r.json()["error"]["message"]
    assert not cluster.servers[P1].received


def run(coro):
    return fakes_run(coro, 30)
