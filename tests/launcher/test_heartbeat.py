"""The restart hold of a crashed SGLang prefill: long enough for every decode's heartbeat to
drop the dead process (heartbeat.py), from the variables the decodes run with."""

from __future__ import annotations

from typing import Any

from backends.launcher import topology_from_dict
from backends.launcher.heartbeat import forget_after_s, restart_hold_s


def topology(**spec: Any) -> Any:
    return topology_from_dict({"model_path": "/m", "prefill": 1, **spec}, variables={})


def test_sglang_defaults_need_three_intervals_of_silence() -> None:
    # 5 s between checks, dropped at the 2nd miss in a row; one interval more for the phase
    assert forget_after_s({}) == 15.0
    assert forget_after_s({"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "3",
                           "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "4"}) == 15.0
    # SGLang's floors: checks at least 2 s apart, at least one miss
    assert forget_after_s({"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "0.1",
                           "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "0"}) == 4.0


def test_the_prefill_waits_for_its_slowest_decode() -> None:
    slow = {"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "10"}
    cluster = topology(backend="sglang", decode=[{}, {"env": slow}])
    prefill, fast_decode, slow_decode = cluster.servers
    assert restart_hold_s(cluster, prefill, {}) == 30.0
    # the launcher's own environment reaches every server, a server's env overrides it
    assert restart_hold_s(cluster, prefill, {"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2"}) \
        == 30.0
    # a decode runs no bootstrap server: nobody caches it, it restarts on its backoff alone
    assert restart_hold_s(cluster, fast_decode, {}) == 0.0
    assert restart_hold_s(cluster, slow_decode, {}) == 0.0


def test_simulated_and_decodeless_clusters_restart_on_the_backoff() -> None:
    simulated = topology(backend="sim", decode=2)
    assert restart_hold_s(simulated, simulated.servers[0], {}) == 0.0
    alone = topology(backend="sglang", decode=0)
    assert restart_hold_s(alone, alone.servers[0], {}) == 0.0
