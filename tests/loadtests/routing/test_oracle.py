"""The sticky oracle's plan-time assignment (`loadtests/routing/oracle.py`), no sockets."""

from __future__ import annotations

import pytest

from loadtests.routing.hard_workloads import AGENT_QUICK, DOCQA_QUICK, agent_plan, docqa_plan
from loadtests.routing.oracle import Structure, assign, replicas, structure
from loadtests.routing.workloads import zipf_weights


def _loads(placed: dict[int, list[int]], weight: dict[int, float], servers: int) -> list[float]:
    load = [0.0] * servers
    for group, where in placed.items():
        for server in where:
            load[server] += weight[group] / len(where)
    return load


@pytest.mark.parametrize(("weight", "prefix", "servers", "cache", "max_load"), [
    pytest.param({0: 0.7, 1: 0.1, 2: 0.1, 3: 0.1}, 4100, 4, 16384, 0.28, id="hot-prompt-on-all"),
    pytest.param({0: 0.5, 1: 0.5}, 2000, 4, 32768, 0.25, id="two-kinds-two-replicas-each"),
    pytest.param(dict(enumerate(zipf_weights(6, 1.0))), 16400, 4, 40960, 0.28,
                 id="docqa-six-documents"),
    pytest.param({0: 1.0}, 500, 3, 4000, 0.34, id="one-prefix-everywhere"),
])
def test_replicas_bring_the_busiest_server_near_its_fair_share(weight, prefix, servers, cache,
                                                                max_load):
    prefixes = dict.fromkeys(weight, prefix)
    placed = replicas(weight, prefixes, servers, cache)
    assert all(len(set(where)) == len(where) for where in placed.values()), placed
    assert max(_loads(placed, weight, servers)) <= max_load, placed


def test_no_server_holds_more_documents_than_fit_while_another_has_room():
    weight = dict(enumerate(zipf_weights(6, 1.0)))
    placed = replicas(weight, dict.fromkeys(weight, 16400), 4, 40960)
    held = [sum(server in where for where in placed.values()) for server in range(4)]
    assert max(held) <= 2, placed


def test_sessions_stick_to_one_replica_of_their_group_and_balance_requests():
    plan = Structure(groups=(0,) * 8 + (1,) * 8, requests=(2,) * 16,
                     prefix_tokens={0: 1000, 1: 1000})
    servers = assign(plan, 4, 10000)
    assert len(servers) == 16
    assert sorted(servers.count(s) for s in range(4)) == [4, 4, 4, 4]
    assert set(servers[:8]).isdisjoint(servers[8:])


@pytest.mark.parametrize("plan", [
    pytest.param(docqa_plan(DOCQA_QUICK, 10.0, 3.0, 0), id="docqa"),
    pytest.param(agent_plan(AGENT_QUICK, 15.0, 3.0, 0), id="agent"),
])
def test_structure_reads_one_group_and_request_count_per_session(plan):
    found = structure(plan)
    assert found is not None and len(found.groups) == len(found.requests) > 0
    assert set(found.groups) <= set(found.prefix_tokens)
    assert all(n >= 1 for n in found.requests)
