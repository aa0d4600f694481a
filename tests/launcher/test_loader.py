"""Topology loading: short specs expand into explicit servers; bad input names the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from backends.launcher import TopologyError, default_topology, load_topology, topology_from_dict
from backends.launcher.commands import REPO_ROOT

VARS = {"HOME": "/root"}


def expand(**spec: Any) -> Any:
    return topology_from_dict({"backend": "sglang", "model_path": "/m", **spec}, variables=VARS)


def test_counts_expand_to_sequential_ports_and_packed_gpus() -> None:
    topology = expand(prefill=1, decode=2, base_port=30000, bootstrap_base_port=8998)
    assert [
        (s.name, s.host, s.port, s.bootstrap_port, s.base_gpu_id) for s in topology.servers
    ] == [
        ("prefill-0", "127.0.0.1", 30000, 8998, 0),
        ("decode-0", "127.0.0.1", 30001, None, 1),
        ("decode-1", "127.0.0.1", 30002, None, 2),
    ]


def test_auto_ports_are_distinct_and_skip_explicit_ones() -> None:
    topology = expand(prefill=[{"port": 31000, "bootstrap_port": 31001}], decode=3)
    ports = [p for s in topology.servers for p in (s.port, s.bootstrap_port) if p]
    assert len(ports) == len(set(ports)) == 5
    assert topology.server("prefill-0").port == 31000


def test_gpu_packing_uses_tp_size_and_avoids_explicit_ids() -> None:
    topology = expand(
        base_port=30000,
        prefill=[{"tp_size": 2, "base_gpu_id": 0}],
        decode=[{"tp_size": 2}, {"tp_size": 4}],
    )
    assert [list(s.gpu_ids) for s in topology.servers] == [[0, 1], [2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize(
    "spec",
    [
        pytest.param({"device": "cpu"}, id="cpu-device"),
        pytest.param({"backend": "sim"}, id="sim-backend"),
    ],
)
def test_no_gpu_packing_without_gpus(spec: dict[str, Any]) -> None:
    topology = expand(base_port=30000, prefill=1, decode=2, **spec)
    assert {s.base_gpu_id for s in topology.servers} == {0}


def test_defaults_merge_all_then_role_then_server() -> None:
    topology = expand(
        base_port=30000,
        defaults={
            "all": {"args": ["--a", 1], "env": {"X": "all", "Y": "all"}, "tp_size": 2},
            "decode": {"args": "--d 'two words'", "env": {"Y": "decode"}},
        },
        prefill=1,
        decode=[{"args": ["--own"], "env": {"Z": True}, "tp_size": 1}],
    )
    prefill, decode = topology.servers
    assert prefill.args == ("--a", "1") and prefill.tp_size == 2
    assert decode.args == ("--a", "1", "--d", "two words", "--own")
    assert decode.env_dict == {"X": "all", "Y": "decode", "Z": "1"}
    assert decode.tp_size == 1


def test_variables_expand_with_defaults() -> None:
    topology = topology_from_dict(
        {
            "backend": "sim",
            "python": "${RIG:-/opt/rig}/bin/python",
            "log_dir": "${HOME}/logs",
            "prefill": 1,
            "decode": 1,
        },
        variables=VARS,
    )
    assert topology.python == "/opt/rig/bin/python"
    assert topology.log_dir == Path("/root/logs")


def test_file_gets_topology_dir_variable(tmp_path: Path) -> None:
    (tmp_path / "t.yaml").write_text(
        "backend: sim\nprefill: 1\ndecode: 1\ndefaults:\n  all:\n"
        "    env: {SHIMS: '${TOPOLOGY_DIR}/shims'}\n"
    )
    topology = load_topology(tmp_path / "t.yaml", variables={})
    assert topology.servers[0].env_dict == {"SHIMS": f"{tmp_path}/shims"}


def test_toml_file(tmp_path: Path) -> None:
    (tmp_path / "t.toml").write_text(
        'backend = "sim"\nbase_port = 40000\nbootstrap_base_port = 41000\n'
        'decode = 1\n[[prefill]]\nhost = "127.0.0.1"\n'
    )
    topology = load_topology(tmp_path / "t.toml", variables={})
    assert [(s.name, s.port) for s in topology.servers] == [
        ("prefill-0", 40000),
        ("decode-0", 40001),
    ]


def test_default_topology_is_one_prefill_two_decode_sims_on_loopback() -> None:
    topology = default_topology()
    assert topology.backend == "sim"
    assert [s.name for s in topology.servers] == ["prefill-0", "decode-0", "decode-1"]
    assert {s.host for s in topology.servers} == {"127.0.0.1"}
    assert topology.servers[0].bootstrap_port is not None


def test_cpu_rig_topology_file_loads() -> None:
    topology = load_topology(
        REPO_ROOT / "deploy/cpu-rig/topology.yaml", variables={"SGLANG_TINY_MODEL": "/m"}
    )
    assert topology.backend == "sglang" and topology.device == "cpu"
    assert [s.role for s in topology.servers] == ["prefill", "decode", "decode"]
    decode = topology.server("decode-0")
    assert "--disaggregation-decode-retraction-backup" in decode.args
    assert decode.env_dict["SGLANG_USE_CPU_ENGINE"] == "1"
    shims = Path(decode.env_dict["PYTHONPATH"])
    assert (shims / "sitecustomize.py").is_file()


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        pytest.param({"backend": "vllm"}, "backend: must be one of sglang, sim", id="backend"),
        pytest.param({"prefil": 1}, "unknown key 'prefil'", id="unknown-top-key"),
        pytest.param({"decode": [{"prot": 1}]}, "decode[0]: unknown key 'prot'", id="server-key"),
        pytest.param({"defaults": {"al": {}}}, "defaults: unknown key 'al'", id="defaults-key"),
        pytest.param({"restart": {"tries": 1}}, "restart: unknown key 'tries'", id="restart-key"),
        pytest.param({"decode": "two"}, "decode: expected a count", id="count-type"),
        pytest.param({"base_port": "x"}, "base_port: expected int", id="int-type"),
        pytest.param({"python": "${NOPE}"}, "python: variable ${NOPE} is not set", id="variable"),
        pytest.param(
            {"decode": [{"bootstrap_port": 1}]},
            "decode[0]: bootstrap_port applies to prefill servers only",
            id="bootstrap-on-decode",
        ),
        pytest.param({"device": "tpu"}, "device: must be one of cuda, cpu", id="device"),
    ],
)
def test_bad_specs_name_the_key(spec: dict[str, Any], problem: str) -> None:
    with pytest.raises(TopologyError) as info:
        expand(**spec)
    assert any(problem in p for p in info.value.problems), info.value.problems


def test_all_problems_reported_at_once() -> None:
    with pytest.raises(TopologyError) as info:
        topology_from_dict({"backend": "x", "bogus": 1, "decode": "y"}, variables={})
    assert len(info.value.problems) == 3
    assert "3 problem(s)" in str(info.value)


def test_unreadable_file_is_a_topology_error(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text("backend: [unclosed")
    with pytest.raises(TopologyError, match="cannot parse"):
        load_topology(tmp_path / "bad.yaml")
    with pytest.raises(TopologyError, match="cannot read"):
        load_topology(tmp_path / "missing.yaml")
