"""Figures of one (router, rate) run, goodput by interpolation, and the printed tables.

A request attains its objectives when it was answered in full (status 200, the stream ended
with `[DONE]`), its TTFT (sending to the first content chunk) is within its `x-slo-ttft-ms`
and its mean inter-token latency (mean gap between content chunks after the first) within its
`x-slo-itl-ms`. Refused requests (429/503) count as not attained and are counted apart, with
how many carried Retry-After; any other failure (timeouts, 5xx, cut streams) is an error.
Percentiles are over the requests answered in full. Completed rate: requests answered in full
per second of arrivals (the plan's duration): the throughput a steady state would sustain.
Over the time to the last answer instead, a 12 s window would lose a third to the drain of
the longest streams (500 tokens take ~5 s), which no router can shorten.

Offered rate: requests sent per second of arrivals. A rate names its plan (workload.py); the
plan offers less, since a conversation that starts late in the window ends with it (the mixed
plans offer about 0.8 of their rate, the hot ones about 0.95). A completed rate is compared
with goodput in the same unit: the offered rate of goodput's plans (`offered_at`).

Goodput is the highest rate with >= 90% attainment, read off the sweep by linear
interpolation: from the lowest rate up, the first swept rate whose attainment is below 0.9 and
the rate before it bracket the crossing, and goodput is where the straight line between their
attainments meets 0.9 (the first crossing, so a noisy recovery at a higher rate does not
count). Below the lowest rate, the line starts at (0 req/s, attainment 1). When every swept
rate attains 0.9, goodput is the highest swept rate and is marked as a lower bound (">=").
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from loadtests.goodput.client import Outcome
from loadtests.goodput.workload import KINDS, Planned
from loadtests.routing.report import percentile, render_markdown, render_text

TARGET = 0.9


def attained(request: Planned, got: Outcome) -> bool:
    if not got.ok or got.ttft is None:
        return False
    itl_ms = (got.itl or 0.0) * 1e3
    return got.ttft * 1e3 <= request.ttft_ms and itl_ms <= request.itl_ms


@dataclass(frozen=True)
class RateRow:
    target: str
    rate: float  # planned requests per second
    sent: int
    attained: int
    refused: int  # 429/503
    refused_retry_after: int  # of those, with a Retry-After header
    errors: int  # neither served in full nor refused
    completed_per_s: float
    offered_per_s: float  # sent per second of arrivals
    ttft_p50_ms: float
    ttft_p90_ms: float
    itl_p50_ms: float
    itl_p90_ms: float
    by_kind: dict[str, float]  # attainment per request kind
    error_samples: list[str] = field(default_factory=list)

    @property
    def attainment(self) -> float:
        return self.attained / self.sent if self.sent else 1.0

    def to_dict(self) -> dict:
        return {**asdict(self), "attainment": self.attainment}


def _pct(values: list[float], q: float) -> float:
    return percentile(values, q) if values else float("nan")


def make_row(target: str, rate: float, pairs: list[tuple[Planned, Outcome]],
             window: float) -> RateRow:
    served = [got for _, got in pairs if got.ok]
    refused = [got for _, got in pairs if got.refused]
    errors = [got.error or "?" for _, got in pairs if not got.ok and not got.refused]
    ttfts = [g.ttft * 1e3 for g in served if g.ttft is not None]
    itls = [g.itl * 1e3 for g in served if g.itl is not None]
    by_kind = {}
    for kind in KINDS:
        mine = [(r, g) for r, g in pairs if r.kind == kind]
        if mine:
            by_kind[kind] = sum(attained(r, g) for r, g in mine) / len(mine)
    return RateRow(
        target=target, rate=rate, sent=len(pairs),
        attained=sum(attained(r, g) for r, g in pairs), refused=len(refused),
        refused_retry_after=sum(g.retry_after for g in refused), errors=len(errors),
        completed_per_s=len(served) / window if window > 0 else 0.0,
        offered_per_s=len(pairs) / window if window > 0 else 0.0,
        ttft_p50_ms=_pct(ttfts, 50), ttft_p90_ms=_pct(ttfts, 90),
        itl_p50_ms=_pct(itls, 50), itl_p90_ms=_pct(itls, 90), by_kind=by_kind,
        error_samples=sorted(set(errors))[:5])


@dataclass(frozen=True)
class Goodput:
    rate: float
    lower_bound: bool  # every swept rate attained: goodput is at least `rate`
    bracket: tuple[float, float] | None  # the swept rates around the crossing

    def __str__(self) -> str:
        return f"{'>=' if self.lower_bound else ''}{self.rate:.1f}"


def goodput(points: list[tuple[float, float]], target: float = TARGET) -> Goodput:
    """Goodput from (rate, attainment) points, as the module's docstring says."""
    ordered = sorted(points)
    previous = (0.0, 1.0)
    for rate, share in ordered:
        if share < target:
            (r0, a0), (r1, a1) = previous, (rate, share)
            crossing = r0 + (a0 - target) * (r1 - r0) / (a0 - a1) if a0 != a1 else r0
            return Goodput(crossing, False, (r0, r1))
        previous = (rate, share)
    return Goodput(ordered[-1][0] if ordered else 0.0, True, None)


def offered_at(rows: list[RateRow], rate: float) -> float:
    """The requests per second a plan at `rate` offers, read off `rows` (one router's runs):
    their offered share of the rate, interpolated linearly between the nearest rates and held
    beyond them."""
    shares = sorted((row.rate, row.offered_per_s / row.rate) for row in rows if row.rate > 0)
    if not shares:
        return rate
    below = [point for point in shares if point[0] <= rate]
    above = [point for point in shares if point[0] >= rate]
    if not below or not above:
        return rate * (above[0][1] if not below else below[-1][1])
    (r0, s0), (r1, s1) = below[-1], above[0]
    share = s0 if r1 == r0 else s0 + (s1 - s0) * (rate - r0) / (r1 - r0)
    return rate * share


HEADER = ("router", "rate", "sent", "attained", "refused (RA)", "errors", "done/s",
          "TTFT p50", "TTFT p90", "ITL p50", "ITL p90", "chat/docqa/short")


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.0f}"


def cells(row: RateRow) -> list[str]:
    kinds = "/".join(f"{100 * row.by_kind[k]:.0f}" if k in row.by_kind else "-" for k in KINDS)
    return [row.target, f"{row.rate:.1f}", str(row.sent), f"{100 * row.attainment:.1f}%",
            f"{row.refused} ({row.refused_retry_after})", str(row.errors),
            f"{row.completed_per_s:.1f}", _ms(row.ttft_p50_ms), _ms(row.ttft_p90_ms),
            _ms(row.itl_p50_ms), _ms(row.itl_p90_ms), kinds]


def sweep_table(rows: list[RateRow]) -> str:
    return render_text(HEADER, [cells(r) for r in rows])


def markdown(rows: list[RateRow], lines: list[str]) -> str:
    """The sweep table and the summary lines, for docs/BENCHMARKS.md."""
    return (render_markdown(HEADER, [cells(r) for r in rows]) + "\n\n"
            + "\n".join(f"* {line}" for line in lines) + "\n")


def summary(goodputs: dict[str, Goodput], capacity: float, ours: str,
            peers: tuple[str, ...]) -> list[str]:
    """One line per router, then ours over each peer and over the capacity bound."""
    lines = [f"goodput {name}: {g} req/s" for name, g in goodputs.items()]
    mine = goodputs.get(ours)
    if mine is None:
        return lines
    for peer in peers:
        other = goodputs.get(peer)
        if other is not None and other.rate > 0:
            lines.append(f"{ours} / {peer}: {mine.rate / other.rate:.2f}x"
                         + (" (a lower bound over a lower bound: not a ratio)"
                            if mine.lower_bound and other.lower_bound else ""))
    if capacity > 0:
        lines.append(f"{ours} / capacity bound ({capacity:.1f} req/s): "
                     f"{mine.rate / capacity:.2f}")
    return lines


def side_by_side(rows: list[RateRow], ours: str, peers: tuple[str, ...]) -> list[str]:
    """At each rate both ran: ours over each peer in completed requests and TTFT p90 (what a
    user past a peer's capacity sees: more answers, sooner)."""
    mine = {row.rate: row for row in rows if row.target == ours}
    lines = []
    for row in rows:
        if row.target not in peers or row.rate not in mine:
            continue
        us = mine[row.rate]
        done = us.completed_per_s / row.completed_per_s if row.completed_per_s else math.inf
        p90 = (us.ttft_p90_ms / row.ttft_p90_ms
               if row.ttft_p90_ms and not math.isnan(row.ttft_p90_ms) else math.nan)
        lines.append(f"at {row.rate:.1f} req/s, {ours} / {row.target}: completed "
                     f"{done:.2f}x, TTFT p90 {p90:.2f}x")
    return lines
