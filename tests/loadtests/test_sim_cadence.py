"""The simulator's cadence benchmark, smoke-sized: it runs and prints one row per stream count.

The ratio is not asserted to be near 1 (that is a speed figure, and this machine's load moves
it); the test checks the table is whole, each ITL positive and each profile step the
profile's own (`TimingProfile.decode_ms`) for that batch.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from backends.sim.timing import H200_LLAMA3_8B
from loadtests.sim_cadence import PROMPT_WORDS
from tests.procs import ROOT


def test_a_row_per_stream_count_with_the_profiles_step():
    tokens = 20
    done = subprocess.run(
        [sys.executable, "-m", "loadtests.sim_cadence", "--streams", "1,3", "--tokens",
         str(tokens)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", done.stdout, re.M)
    assert [int(r[0]) for r in rows] == [1, 3], done.stdout
    for streams, itl, step, ratio in rows:
        n = int(streams)
        assert float(itl) > 0
        assert float(step) == pytest.approx(
            H200_LLAMA3_8B.decode_ms(n, n * (PROMPT_WORDS + tokens // 2)), abs=0.006)
        assert float(ratio) == pytest.approx(float(itl) / float(step), abs=0.02)
