"""The throughput benchmark runs clean: every pair answered and validated, no errors.

Its speed is a benchmark figure (docs/SIMULATOR.md, "Throughput"), not a test assertion."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.sim.simproc import ROOT

pytestmark = pytest.mark.timeout(120)


def test_bench_runs_clean():
    out = subprocess.run(
        [sys.executable, "-m", "backends.sim.bench", "--pairs", "32", "--duration", "1.5",
         "--warmup", "0.5", "--cpu", "none", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["errors"] == 0 and result["checked_pairs"] > 0
