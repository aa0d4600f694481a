"""`python -m loadtests.rebalance --quick`: the table's structure, no request lost to a switch,
and the rebalancer moved a decode to prefill while the prompts were long (and back), which
the static run of the same split never does."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.procs import ROOT

pytestmark = pytest.mark.timeout(400)


def test_quick_run(tmp_path):
    out = tmp_path / "rebalance.json"
    result = subprocess.run(
        [sys.executable, "-m", "loadtests.rebalance", "--quick", "--out", str(out),
         "--log-dir", str(tmp_path / "logs")],
        cwd=ROOT, capture_output=True, text=True, timeout=380)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("| run | start | long outputs | long prompts |"), lines[0]
    assert lines[2].startswith("| rebalance | 1P:2D |")
    assert lines[3].startswith("| static 1P:2D | 1P:2D |")
    assert "x the starting split 1P:2D" in result.stdout
    runs = {r["name"]: r for r in json.loads(out.read_text())}
    auto, static = runs["rebalance"], runs["static 1P:2D"]
    assert auto["lost"] == 0 and static["lost"] == 0
    assert sum(n for n, _ in auto["phases"].values()) == sum(
        n for n, _ in static["phases"].values()) > 50  # the same plan
    switched = {k: v for k, v in auto["switches"].items() if k.endswith(":switched")}
    assert any(k.startswith("decode>prefill:prefill_") for k in switched), auto["switches"]
    assert not static["switches"]
    # the phases after the shift were served better with a second prefill (each phase alone
    # swings with when the switch lands on a busy machine: one CI run met 5 = 5 long prompts)
    shifted = ("long prompts", "long outputs again")
    assert sum(auto["phases"][p][1] for p in shifted) > sum(
        static["phases"][p][1] for p in shifted), result.stdout
