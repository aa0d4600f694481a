"""Figures of the DP-rank workloads: per-rank share, hit ratio against one rank, the verdicts.

*Share*: the requests a DP rank served over those its server served (the simulator's per-rank
counters, `/sim/stats` `dp_ranks`), for every rank of every prefill server that served any
(a server that served none shows as `idle`); min and max over them, and the fair share 1/ranks. A request that failed before it reached a
rank's scheduler (the plain-DP room conflict) counts for no rank, only as an error.
*Hit rate*: cached over prompt tokens counted by the prefill servers, as in the other tables;
*vs 1 rank*: the hit rate with ranks over the same target's on the same workload with one rank
per server and the same cache per server.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from loadtests.routing.report import Row, render_markdown, render_text

SHARE_FLOOR = 0.15  # the issue's bound: each rank gets at least 15% of its server's requests
RATIO_FLOOR = 0.98  # hit rate with ranks >= 0.98x the one-rank hit rate


@dataclass(frozen=True)
class DpRow:
    target: str
    layout: str  # "attention DP x4", "plain DP x4"
    requests: int
    errors: int
    shares: list[list[float]]  # per prefill server, per rank; [] for a server that served none
    fair: float
    hit_rate: float
    base_hit_rate: float | None  # same target, one rank per server (chat only)
    ttft_p50_ms: float
    base_ttft_p50_ms: float | None
    error_samples: list[str]

    @property
    def share_min(self) -> float:
        return min((s for server in self.shares for s in server), default=float("nan"))

    @property
    def share_max(self) -> float:
        return max((s for server in self.shares for s in server), default=float("nan"))

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    @property
    def hit_ratio(self) -> float | None:
        if self.base_hit_rate is None:
            return None
        return self.hit_rate / self.base_hit_rate if self.base_hit_rate else float("nan")

    def to_dict(self) -> dict:
        return {**asdict(self), "share_min": self.share_min, "share_max": self.share_max,
                "error_rate": self.error_rate, "hit_ratio": self.hit_ratio}


def rank_shares(per_rank: list[list[int]]) -> list[list[float]]:
    return [[c / sum(ranks) for c in ranks] if sum(ranks) else [] for ranks in per_rank]


def dp_row(row: Row, layout: str, ranks: int, base: Row | None = None) -> DpRow:
    return DpRow(
        target=row.target, layout=layout, requests=row.requests, errors=row.errors,
        shares=rank_shares(row.per_rank), fair=1 / ranks, hit_rate=row.hit_rate,
        base_hit_rate=None if base is None else base.hit_rate, ttft_p50_ms=row.ttft_p50_ms,
        base_ttft_p50_ms=None if base is None else base.ttft_p50_ms,
        error_samples=row.error_samples)


HEADER = ("target", "layout", "reqs", "errors", "rank share min/max % (fair)",
          "per-rank share % (each prefill)", "hit rate", "hit 1 rank", "vs 1 rank",
          "TTFT p50 ms", "TTFT p50 1 rank ms")


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None or math.isnan(value) else format(value, fmt)


def cells(row: DpRow) -> list[str]:
    share = (f"{_num(100 * row.share_min, '.1f')}/{_num(100 * row.share_max, '.1f')} "
             f"({100 * row.fair:.0f})")
    per_rank = ", ".join("/".join(f"{100 * s:.0f}" for s in server) or "idle"
                         for server in row.shares)
    errors = f"{row.errors} ({100 * row.error_rate:.0f}%)" if row.errors else "0"
    base = None if row.base_hit_rate is None else 100 * row.base_hit_rate
    return [row.target, row.layout, str(row.requests), errors, share, per_rank or "-",
            f"{100 * row.hit_rate:.1f}%", _num(base, ".1f") + ("%" if base is not None else ""),
            _num(row.hit_ratio, ".3f") + ("x" if row.hit_ratio is not None else ""),
            _num(row.ttft_p50_ms, ".1f"), _num(row.base_ttft_p50_ms, ".1f")]


def text_table(rows: list[DpRow]) -> str:
    return render_text(HEADER, [cells(r) for r in rows], left=2)


def markdown_table(rows: list[DpRow]) -> str:
    return render_markdown(HEADER, [cells(r) for r in rows], left=2)


def share_verdicts(rows: list[DpRow]) -> list[str]:
    """Per target: is every rank at or above SHARE_FLOOR of its server's requests?"""
    out = []
    for row in rows:
        met = row.share_min >= SHARE_FLOOR
        out.append(f"{row.target} ({row.layout}): min rank share {100 * row.share_min:.1f}% "
                   f"(>= {100 * SHARE_FLOOR:.0f}%: {'met' if met else 'NOT met'}), "
                   f"errors {row.errors}/{row.requests}")
    return out


def ratio_verdicts(rows: list[DpRow]) -> list[str]:
    """Per target: hit rate with ranks against one rank, and the RATIO_FLOOR bound."""
    out = []
    for row in rows:
        if row.hit_ratio is None or row.base_hit_rate is None:
            continue
        met = row.hit_ratio >= RATIO_FLOOR
        out.append(f"{row.target} ({row.layout}): hit {100 * row.hit_rate:.1f}% vs "
                   f"{100 * row.base_hit_rate:.1f}% with 1 rank = {row.hit_ratio:.3f}x "
                   f"(>= {RATIO_FLOOR}x: {'met' if met else 'NOT met'})")
    return out
