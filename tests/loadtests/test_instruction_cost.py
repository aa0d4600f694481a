"""The instruction-count benchmark: per request, a count the long run's extra requests explain
(of the size of a request, not of a run), the same for a checkout measured twice."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from loadtests import instruction_cost

pytestmark = [pytest.mark.skipif(shutil.which("valgrind") is None, reason="needs valgrind"),
              pytest.mark.timeout(900)]  # four runs under valgrind, 40x slower each
ROOT = Path(__file__).resolve().parents[2]


def test_the_table_compares_this_checkout_with_a_base(capsys):
    # 576 requests between the runs: a collector pass that lands in one run and not the
    # other moves a shorter difference by tens of percent
    assert instruction_cost.main(["--configs", "fixed", "--small", "128", "--large", "704",
                                  "--base", str(ROOT)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| fixed")]
    assert len(rows) == 1
    cells = rows[0].strip("| ").split(" | ")
    ours, base = (float(c.replace(",", "")) for c in cells[1:3])
    assert 10_000 < ours < 5_000_000, ours  # a request, not noise and not a whole run
    assert float(cells[3].rstrip("x")) == pytest.approx(1.0, abs=0.15)  # one tree twice
    assert base > 0
