"""`enable_pd_role_switch` in a topology: the flag on both backends' commands, and a bootstrap
port for every server that has it (SGLang then runs a bootstrap server on every PD instance)."""

from __future__ import annotations

import sys

import pytest

from backends.launcher import ServerSpec, Topology, build_command, find_problems
from backends.launcher.loader import topology_from_dict


def spec(data: dict) -> Topology:
    return topology_from_dict({"backend": "sim", "base_port": 41000,
                               "bootstrap_base_port": 42000, **data})


def test_top_level_flag_reaches_every_pd_server_and_gives_decodes_bootstrap_ports():
    topology = spec({"prefill": 1, "decode": 2, "plain": 1, "enable_pd_role_switch": True})
    by_name = {s.name: s for s in topology.servers}
    assert [by_name[n].pd_role_switch for n in ("prefill-0", "decode-0", "decode-1",
                                                "plain-0")] == [True, True, True, False]
    ports = [by_name[n].bootstrap_port for n in ("prefill-0", "decode-0", "decode-1")]
    assert ports == [42000, 42001, 42002]
    assert by_name["plain-0"].bootstrap_port is None


def test_a_server_table_overrides_the_top_level():
    topology = spec({"prefill": 1, "decode": [{"enable_pd_role_switch": False}, {}],
                     "enable_pd_role_switch": True})
    decodes = topology.by_role("decode")
    assert [(s.pd_role_switch, s.bootstrap_port is not None) for s in decodes] == [
        (False, False), (True, True)]


def test_without_the_flag_nothing_changes():
    topology = spec({"prefill": 1, "decode": 1})
    assert [s.pd_role_switch for s in topology.servers] == [False, False]
    assert topology.by_role("decode")[0].bootstrap_port is None
    assert "--enable-pd-role-switch" not in build_command(topology, topology.servers[1]).argv


@pytest.mark.parametrize(("backend", "port_flag"), [("sglang", "--disaggregation-bootstrap-port"),
                                                     ("sim", "--bootstrap-port")])
def test_commands_carry_the_flag_and_the_decode_bootstrap_port(backend, port_flag):
    decode = ServerSpec("decode", 0, "127.0.0.1", 30001, bootstrap_port=9001,
                        pd_role_switch=True)
    topology = Topology(backend=backend, servers=(decode,), python="py", model_path="/m")
    argv = list(build_command(topology, decode).argv)
    assert "--enable-pd-role-switch" in argv
    assert argv[argv.index(port_flag) + 1] == "9001"


def test_a_role_switching_decode_needs_a_bootstrap_port():
    decode = ServerSpec("decode", 0, "127.0.0.1", 30001, base_gpu_id=1, pd_role_switch=True)
    prefill = ServerSpec("prefill", 0, "127.0.0.1", 30000, bootstrap_port=8998)
    topology = Topology(backend="sglang", servers=(prefill, decode), python=sys.executable,
                        model_path="org/model")
    assert find_problems(topology, check_ports=False) == [
        "decode-0: a server with enable_pd_role_switch needs a bootstrap_port (SGLang runs a "
        "bootstrap server on it)"]


def test_a_wrong_type_is_named():
    with pytest.raises(Exception, match="enable_pd_role_switch: expected bool"):
        spec({"prefill": 1, "decode": 1, "enable_pd_role_switch": "yes"})
