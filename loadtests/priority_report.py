"""The priority load test's table: one row per target and tenant, and the goal's verdict.

The interactive tenant's latency p99 under the flood is compared with its p99 alone (target
`alone`): the goal is at most `GOAL` times that with priorities on, every interactive request
served. Percentiles are over the
answered requests; shed ones are counted apart, so a proxy cannot look fast by refusing the
interactive tenant (a shed interactive request shows in its `shed` column).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from loadtests.routing.report import render_markdown, render_text

GOAL = 1.5  # interactive p99 under the flood, at most this many times its p99 alone
BASELINE = "alone"
INTERACTIVE = "app"
HEADER = ("target", "tenant", "requests", "ok", "shed", "errors", "ok/s", "TTFT p50 ms",
          "TTFT p99 ms", "latency p50 ms", "latency p99 ms", "p99 vs alone",
          "queued wait ms")


@dataclass(frozen=True)
class Row:
    target: str
    tenant: str
    requests: int  # sent in the window
    ok: int
    shed: int  # 429/503 from admission
    errors: int  # every other failure
    ok_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    latency_p50_ms: float
    latency_p99_ms: float
    queue_wait_ms: float  # our gateway's mean wait of the tenant's queued requests (NaN: peer)
    error_samples: list[str] = field(default_factory=list)


def baseline(rows: list[Row]) -> float | None:
    """The interactive tenant's latency p99 alone, if that target ran and answered."""
    for row in rows:
        if row.target == BASELINE and row.tenant == INTERACTIVE and row.ok:
            return row.latency_p99_ms
    return None


def ratio(row: Row, base: float | None) -> float | None:
    if row.tenant != INTERACTIVE or not base or math.isnan(row.latency_p99_ms):
        return None
    return row.latency_p99_ms / base


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.0f}"


def cells(row: Row, base: float | None) -> list[str]:
    times = ratio(row, base)
    return [row.target, row.tenant, str(row.requests), str(row.ok), str(row.shed),
            str(row.errors), f"{row.ok_per_s:.1f}", _ms(row.ttft_p50_ms), _ms(row.ttft_p99_ms),
            _ms(row.latency_p50_ms), _ms(row.latency_p99_ms),
            "-" if times is None else f"{times:.2f}x", _ms(row.queue_wait_ms)]


def text_table(rows: list[Row]) -> str:
    base = baseline(rows)
    return render_text(HEADER, [cells(r, base) for r in rows], left=2)


def markdown_table(rows: list[Row]) -> str:
    base = baseline(rows)
    return render_markdown(HEADER, [cells(r, base) for r in rows], left=2)


def goal_lines(rows: list[Row]) -> list[str]:
    """One line per flooded target: the interactive p99 against the goal."""
    base = baseline(rows)
    if base is None:
        return ["no baseline: target 'alone' did not run or answered nothing"]
    lines = []
    for row in rows:
        times = ratio(row, base)
        if row.target == BASELINE or times is None:
            continue
        held = times <= GOAL and row.ok == row.requests  # a refused request was not served
        lines.append(f"{row.target}: interactive latency p99 {row.latency_p99_ms:.0f} ms = "
                     f"{times:.2f}x alone ({base:.0f} ms), {row.requests - row.ok} of "
                     f"{row.requests} interactive requests not served: "
                     f"{'meets' if held else 'misses'} the goal (<= {GOAL:g}x, all served)")
    return lines
