"""The n > 1 first-event benchmark, smoke-sized: it runs and prints one whole row per n.

No speed is asserted (a benchmark's figure, moved by this machine's load): the rows are
whole, every time positive, the first event within its stream, and n = 1 the ratios' base.
"""

from __future__ import annotations

import re
import subprocess
import sys

from tests.procs import ROOT

ROW = re.compile(r"^\| (\w+) \| (\d+) \| (\d+) \| ([\d.]+) \| ([\d.]+)x \| ([\d.]+) \|$", re.M)


def test_a_row_per_n_with_its_first_event_inside_its_stream():
    done = subprocess.run(
        [sys.executable, "-m", "loadtests.samples_first_token", "--n", "1,2", "--requests",
         "2"], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = ROW.findall(done.stdout)
    assert [(r[0], int(r[1]), int(r[2])) for r in rows] == [("gateway", 1, 2),
                                                          ("gateway", 2, 2)], done.stdout
    for _, _, _, first, _ratio, whole in rows:
        assert 0 < float(first) < float(whole)
    assert float(rows[0][4]) == 1.0
