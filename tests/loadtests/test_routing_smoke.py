"""The routing-quality benchmark, `--quick` (2 prefill + 1 decode sims, our gateway only).

The quick chat workload is built so that the difference is structural, not luck: histories
grow by ~100-180 tokens a turn over a 200-token system prompt, so a router that keeps each
conversation on one prefill server reuses all but the newest turn, while round_robin lands
half the turns on the other server and loses at least one more turn (and its duplicated
histories overflow the 2,500-token caches).
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.procs import ROOT


def test_quick_run_has_no_errors_and_cache_aware_beats_round_robin_on_chat(tmp_path):
    out = tmp_path / "routing.json"
    done = subprocess.run(
        [sys.executable, "-m", "loadtests.routing", "--quick", "--workload", "both",
         "--out", str(out), "--log-dir", str(tmp_path / "logs")],
        capture_output=True, text=True, timeout=240, cwd=ROOT)
    output = done.stdout[-4000:] + done.stderr[-4000:]
    assert done.returncode == 0, output

    results = json.loads(out.read_text())
    assert set(results["workloads"]) == {"chat", "fewshot"}, output
    for workload in results["workloads"].values():
        for row in workload["rows"]:
            assert row["requests"] > 10, (row["target"], output)
            assert row["errors"] == 0, (row["target"], row["error_samples"])
            assert row["ttft_p50_ms"] > 0, row
    chat = {row["target"]: row for row in results["workloads"]["chat"]["rows"]}
    cache_aware, round_robin = chat["gateway:cache_aware"], chat["gateway:round_robin"]
    assert cache_aware["hit_rate"] > round_robin["hit_rate"] + 0.05, output
    # The servers' counters and the answers' usage figures agree.
    for row in chat.values():
        assert abs(row["hit_rate"] - row["client_hit_rate"]) < 0.02, row
