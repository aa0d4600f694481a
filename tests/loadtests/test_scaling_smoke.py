"""The multi-core benchmark, smoke-sized: our gateway at 1 and 2 workers on loopback.

Nothing is pinned on a 2-core machine (the layout needs two CPUs beside the proxy's), so the
figures say nothing about speed; the test checks that every part runs, every measured row
has traffic and no errors, and that the tables are written. The peers join when their venv
is ready (loadtests/peers.py), never installed by the test.
"""

from __future__ import annotations

import json
import subprocess
import sys

from loadtests import peers, scaling
from loadtests.cluster import Cluster
from loadtests.targets import TARGETS as PROXIES
from tests.procs import ROOT


def test_gateway_at_one_and_two_workers_serves_without_errors(tmp_path):
    targets = ["gateway", "gateway-reuseport"]
    if peers.ready(peers.DEFAULT_VENV):
        targets += ["sglang-router", "mini-lb"]
    out, markdown = tmp_path / "scaling.json", tmp_path / "scaling.md"
    done = subprocess.run(
        [sys.executable, "-m", "loadtests.scaling", "--quick", "--workers", "1,2",
         "--duration", "1", "--targets", ",".join(targets), "--timeout", "80",
         "--out", str(out), "--markdown", str(markdown), "--log-dir", str(tmp_path / "logs")],
        capture_output=True, text=True, timeout=90, cwd=ROOT)
    output = done.stdout[-4000:] + done.stderr[-4000:]
    assert done.returncode == 0, output

    points = json.loads(out.read_text())["points"]
    measured = {(p["target"], p["workers"]) for p in points}
    assert {("gateway", 1), ("gateway", 2), ("gateway-reuseport", 2)} <= measured, output
    for point in points:
        assert point["rps"] > 0, (point, output)
        assert point["requests"] > 0, point
        assert point["errors"] == 0, (point, output)
        assert point["cpu_per_1k"] is not None and point["cpu_per_1k"] > 0, point
    gateway_2 = next(p for p in points if (p["target"], p["workers"]) == ("gateway", 2))
    assert gateway_2["scaling"] is not None, gateway_2
    assert gateway_2["process_max"] is not None, gateway_2  # two workers seen separately

    tables = markdown.read_text()
    for target, workers in measured:
        assert f"| {target} | {workers} |" in tables, tables


def test_round_robin_target_runs_n_workers_without_a_choice_and_is_asked_by_name():
    """`gateway-rr` is the gateway at N workers with the cheapest pick (what the default
    policies cost at N cores); the default run keeps its four targets."""
    target = scaling.TARGETS["gateway-rr"]
    farm = Cluster("pdstub", [31001, 31002], 31009, [31003, 31004])
    argv = PROXIES[target.proxy].argv(farm, 31000, None) + target.flags(4)
    assert argv[argv.index("--policy") + 1] == "round_robin"
    assert argv[argv.index("--workers") + 1] == "4"
    assert argv.count("--prefill") == 2 and argv.count("--decode") == 2
    assert "gateway-rr" not in scaling.parse_args([]).targets
    assert scaling.parse_args(["--targets", "gateway-rr"]).targets == ["gateway-rr"]


def test_one_role_round_robin_targets_keep_the_default_for_the_other_role():
    """`gateway-prefill-rr` and `gateway-decode-rr` tell which role's choice costs what:
    round robin for the named role only, asked by name."""
    farm = Cluster("pdstub", [31001, 31002], 31009, [31003, 31004])
    for name, flag, other in (("gateway-prefill-rr", "--prefill-policy", "--decode-policy"),
                              ("gateway-decode-rr", "--decode-policy", "--prefill-policy")):
        target = scaling.TARGETS[name]
        argv = PROXIES[target.proxy].argv(farm, 31000, None) + target.flags(8)
        assert argv[argv.index(flag) + 1] == "round_robin"
        assert other not in argv and "--policy" not in argv
        assert argv[argv.index("--workers") + 1] == "8"
        assert name not in scaling.parse_args([]).targets
