"""Topologies of several models: `models:` groups, per-server model keys, per-model checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from backends.launcher import TopologyError, find_problems, load_topology, topology_from_dict
from backends.launcher.commands import build_command

ROOT = Path(__file__).resolve().parents[2]
VARS = {"HOME": "/root"}


def expand(**spec: Any):
    return topology_from_dict({"backend": "sglang", **spec}, variables=VARS)


def flag(argv: tuple[str, ...], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_models_expand_into_servers_of_their_model() -> None:
    topology = expand(base_port=30000, bootstrap_base_port=8998, models=[
        {"model_name": "llama", "model_path": "meta/llama", "prefill": 1, "decode": 2},
        {"model_name": "qwen", "model_path": "qwen/qwen", "prefill": 1,
         "decode": [{"tp_size": 2}]},
    ])
    rows = [(s.name, topology.model_name_of(s), topology.model_path_of(s), s.tp_size)
            for s in topology.servers]
    assert rows == [
        ("prefill-0", "llama", "meta/llama", 1), ("prefill-1", "qwen", "qwen/qwen", 1),
        ("decode-0", "llama", "meta/llama", 1), ("decode-1", "llama", "meta/llama", 1),
        ("decode-2", "qwen", "qwen/qwen", 2),
    ]
    for server in topology.servers:
        argv = build_command(topology, server).argv
        assert flag(argv, "--model-path") == topology.model_path_of(server)
        assert flag(argv, "--served-model-name") == topology.model_name_of(server)
    assert len({s.port for s in topology.servers}) == 5  # ports still distinct over models
    assert find_problems(topology, check_ports=False) == []


def test_a_server_table_names_its_own_model_over_the_top_level() -> None:
    topology = topology_from_dict({"backend": "sim", "model_name": "a", "prefill": 1,
                                   "decode": [{}, {"model_name": "b"}]})
    names = [flag(build_command(topology, s).argv, "--served-model-name")
             for s in topology.servers]
    assert names == ["a", "a", "b"]
    # b has a decode and no prefill: each model is its own PD cluster
    assert find_problems(topology, check_ports=False) == [
        "model b: PD needs both roles: 0 prefill and 1 decode"]


def test_every_models_path_is_checked(tmp_path: Path) -> None:
    present = tmp_path / "present"
    present.mkdir()
    topology = expand(models=[
        {"model_name": "x", "model_path": str(present), "prefill": 1, "decode": 1},
        {"model_name": "y", "model_path": str(tmp_path / "missing"), "prefill": 1, "decode": 1},
    ])
    problems = find_problems(topology, check_ports=False)
    assert [p for p in problems if "model_path" in p] == [
        f"model_path: {tmp_path / 'missing'} does not exist"]


@pytest.mark.parametrize("models, problem", [
    ([{"model_name": "x", "prefill": 1, "decode": 1, "tp": 2}], "models[0]: unknown key 'tp'"),
    ([{"prefill": 1, "decode": 1}], "models[0]: needs model_name or model_path"),
    ({"x": {}}, "models: expected a list of model tables"),
    ([{"model_name": "x", "prefill": [{"gpu": 1}]}], "models[0].prefill[0]: unknown key 'gpu'"),
], ids=["unknown-key", "no-name", "not-a-list", "bad-server-key"])
def test_bad_models_name_the_entry(models: Any, problem: str) -> None:
    with pytest.raises(TopologyError) as info:
        topology_from_dict({"backend": "sim", "models": models})
    assert any(problem in p for p in info.value.problems), info.value.problems


def test_the_two_model_sim_topology_file_loads() -> None:
    topology = load_topology(ROOT / "deploy/sim/topology-two-models.yaml", variables=VARS)
    by_model: dict[str, list[str]] = {}
    for server in topology.servers:
        by_model.setdefault(topology.model_name_of(server), []).append(server.role)
    assert by_model == {"large": ["prefill", "prefill", "decode"],
                        "small": ["prefill", "decode"]}
    assert find_problems(topology, check_ports=False) == []
