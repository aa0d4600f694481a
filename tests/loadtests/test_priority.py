"""The priority load test, tiny: every part runs, the table has its rows, the interactive
tenant is served. No timing is asserted (two shared cores say nothing about p99); the
peer joins only when its venv is ready (loadtests/peers.py), never installed by the test.
"""

from __future__ import annotations

import json
import subprocess
import sys

from loadtests import peers
from loadtests.priority_report import HEADER
from tests.procs import ROOT


def test_priority_run_reports_every_target_and_serves_the_interactive_tenant(tmp_path):
    targets = ["alone", "gateway", "fifo"]
    if peers.ready(peers.DEFAULT_VENV):
        targets.append("sglang-router")
    out, markdown = tmp_path / "priority.json", tmp_path / "priority.md"
    done = subprocess.run(
        [sys.executable, "-m", "loadtests.priority", "--targets", ",".join(targets),
         "--duration", "2", "--warmup", "0.5", "--rate", "4", "--flood", "6",
         "--max-concurrency", "2", "--max-queue", "4", "--tokens", "8", "--timeout", "100",
         "--out", str(out), "--markdown", str(markdown), "--log-dir", str(tmp_path / "logs")],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    output = done.stdout[-4000:] + done.stderr[-4000:]
    assert done.returncode == 0, output

    rows = json.loads(out.read_text())["rows"]
    seen = [(r["target"], r["tenant"]) for r in rows]
    expected = [("alone", "app")] + [(t, tenant) for t in targets[1:]
                                     for tenant in ("app", "bulk")]
    assert seen == expected, output
    for row in rows:
        assert row["requests"] == row["ok"] + row["shed"] + row["errors"], row
        assert row["requests"] > 0, row
    for row in rows:
        if row["target"] in ("alone", "gateway") and row["tenant"] == "app":
            assert row["ok"] > 0, (row, output)  # classes and weights let it through

    tables = markdown.read_text()
    assert "| " + " | ".join(HEADER) + " |" in tables, tables
    for target, tenant in expected:
        assert f"| {target} | {tenant} |" in tables, tables
    assert "gateway: interactive latency p99" in tables, tables
