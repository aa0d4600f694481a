"""The locustfile, headless for ~10 s against a simulated cluster and the gateway.

Needs locust (`pip install -e '.[dev,load]'`); skipped with that hint when it is missing.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
import sys

import pytest

from tests.integration.conftest import sim_cluster
from tests.procs import ROOT

# Only look for locust: importing it here would gevent-patch this whole pytest process.
if importlib.util.find_spec("locust") is None:
    pytest.skip("locust is not installed: pip install -e '.[dev,load]'", allow_module_level=True)

LOCUSTFILE = ROOT / "loadtests" / "locustfile.py"
REQUESTS = ["/v1/chat/completions", "/v1/chat/completions stream", "/v1/completions",
            "/v1/completions stream"]
METRICS = ["TTFT chat", "ITL chat", "TTFT completions", "ITL completions"]


def test_locust_headless_run_succeeds_and_records_ttft_and_itl(tmp_path):
    env = {**os.environ, "LOAD_MAX_TOKENS": "16", "LOAD_PROMPT_WORDS": "5-40",
           "LOAD_SHARED_PREFIX_WORDS": "30",
           "LOAD_WEIGHTS": "chat_stream=1,chat=1,completions_stream=1,completions=1"}
    with sim_cluster(tmp_path) as cluster:
        done = subprocess.run(
            [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
             "-u", "8", "-r", "8", "-t", "10s", "--stop-timeout", "5",
             "--host", cluster.gateway, "--csv", str(tmp_path / "run"), "--only-summary"],
            capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    output = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 0, output

    with open(tmp_path / "run_stats.csv", newline="") as f:
        rows = {row["Name"]: row for row in csv.DictReader(f)}
    for name in REQUESTS + METRICS:
        assert name in rows, f"no {name!r} entry:\n{output}"
        assert int(rows[name]["Request Count"]) > 0, name
        assert int(rows[name]["Failure Count"]) == 0, name
    assert rows["Aggregated"]["Failure Count"] == "0", output
    for name in METRICS:
        assert rows[name]["Type"] == "SSE"
    # Every stream reported one TTFT: as many as streaming requests.
    assert rows["TTFT chat"]["Request Count"] == rows["/v1/chat/completions stream"][
        "Request Count"]
