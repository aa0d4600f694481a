"""The table of the harder workloads and the issue's done-when verdicts for our default policy.

Columns: the servers' hit ratio (cached over prompt tokens, as in the other routing tables),
that ratio over the oracle's, TTFT p50/p90 (client, first content), the busiest prefill
server's share of the requests against the fair share (1 / prefill servers), errors.

Done-when, for `DEFAULT` on every workload: hit ratio >= 0.97x the oracle's where it ran, and
TTFT p50 <= 0.6x sglang-router cache_aware's; on `hot` also the busiest prefill at most 1.5x
its fair share while the hit ratio stays within 5 points of the best row (the oracle
included).

`python -m loadtests.routing.hard_report results.json` prints the Markdown tables and verdicts
of a run written with `--out` (for docs/BENCHMARKS.md).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from loadtests.routing.report import Row, render_markdown, render_text

DEFAULT = "gateway:cache_aware"
PEER = "sglang-router:cache_aware"
ORACLE = "oracle"
ORACLE_FLOOR = 0.97
PEER_TTFT_CEIL = 0.6
HOT_SHARE_CEIL = 1.5
HOT_HIT_POINTS = 0.05

HEADER = ("target", "reqs", "errors", "hit ratio", "vs oracle", "TTFT p50 ms", "TTFT p90 ms",
          "busiest prefill % (x fair)", "prefill share %")


def busiest(row: Row) -> tuple[float, float]:
    """The busiest prefill server's share of the requests, and that over the fair share."""
    total = sum(row.per_server)
    if not total:
        return float("nan"), float("nan")
    share = max(row.per_server) / total
    return share, share * len(row.per_server)


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1f}"


def cells(row: Row, oracle: Row | None) -> list[str]:
    share, times = busiest(row)
    ratio = "-" if oracle is None or not oracle.hit_rate else f"{row.hit_rate / oracle.hit_rate:.3f}"
    errors = f"{row.errors} ({100 * row.errors / row.requests:.0f}%)" if row.errors else "0"
    total = sum(row.per_server) or 1
    return [row.target, str(row.requests), errors, f"{100 * row.hit_rate:.1f}%", ratio,
            _ms(row.ttft_p50_ms), _ms(row.ttft_p90_ms),
            "-" if math.isnan(share) else f"{100 * share:.0f} ({times:.2f}x)",
            "/".join(f"{100 * c / total:.0f}" for c in row.per_server)]


def _oracle(rows: list[Row]) -> Row | None:
    return next((r for r in rows if r.target == ORACLE), None)


def text_table(rows: list[Row]) -> str:
    oracle = _oracle(rows)
    return render_text(HEADER, [cells(r, oracle) for r in rows])


def markdown_table(rows: list[Row]) -> str:
    oracle = _oracle(rows)
    return render_markdown(HEADER, [cells(r, oracle) for r in rows])


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def verdicts(workload: str, rows: list[Row]) -> list[str]:
    """The done-when criteria for DEFAULT on one workload, one line each (skipped when a row
    they need is missing)."""
    by_name = {r.target: r for r in rows}
    ours = by_name.get(DEFAULT)
    if ours is None:
        return []
    out = []
    oracle, peer = by_name.get(ORACLE), by_name.get(PEER)
    if oracle is not None and oracle.hit_rate:
        ratio = ours.hit_rate / oracle.hit_rate
        out.append(f"{workload}: hit {100 * ours.hit_rate:.1f}% vs oracle "
                   f"{100 * oracle.hit_rate:.1f}% = {ratio:.3f}x (>= {ORACLE_FLOOR}x: "
                   f"{_met(ratio >= ORACLE_FLOOR)})")
    if peer is not None and peer.ttft_p50_ms > 0:
        ratio = ours.ttft_p50_ms / peer.ttft_p50_ms
        out.append(f"{workload}: TTFT p50 {ours.ttft_p50_ms:.1f} vs {PEER} "
                   f"{peer.ttft_p50_ms:.1f} ms = {ratio:.2f}x (<= {PEER_TTFT_CEIL}x: "
                   f"{_met(ratio <= PEER_TTFT_CEIL)})")
    if workload == "hot":
        share, times = busiest(ours)
        out.append(f"{workload}: busiest prefill {100 * share:.0f}% = {times:.2f}x fair "
                   f"(<= {HOT_SHARE_CEIL}x: {_met(times <= HOT_SHARE_CEIL)})")
        best = max(rows, key=lambda r: r.hit_rate)
        gap = best.hit_rate - ours.hit_rate
        out.append(f"{workload}: hit {100 * ours.hit_rate:.1f}% vs best {best.target} "
                   f"{100 * best.hit_rate:.1f}% ({100 * gap:.1f} points; <= "
                   f"{100 * HOT_HIT_POINTS:.0f}: {_met(gap <= HOT_HIT_POINTS)})")
    return out


def rows_from(section: dict) -> list[Row]:
    """The rows of one workload back from `--out` JSON."""
    fields = set(Row.__dataclass_fields__)
    return [Row(**{k: v for k, v in row.items() if k in fields}) for row in section["rows"]]


def main(argv: list[str]) -> int:
    results = json.loads(Path(argv[0]).read_text())
    for name, section in results["workloads"].items():
        if "verdicts" in section and "rows" in section:
            print(f"{name}:\n\n{markdown_table(rows_from(section))}\n")
            print("\n".join(section["verdicts"]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
