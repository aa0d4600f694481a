"""The rebalancing benchmark's table and summary."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class Result:
    name: str
    start: str  # the split the run started with
    phases: dict[str, list[int]]  # phase -> [requests, attained]
    lost: int  # requests without a complete 200 stream
    seconds: float  # of arrivals
    switches: dict[str, float]  # "from>to:reason:outcome" -> count
    end: str  # the split it ended with

    @property
    def attained(self) -> int:
        return sum(a for _, a in self.phases.values())

    @property
    def requests(self) -> int:
        return sum(n for n, _ in self.phases.values())

    @property
    def goodput(self) -> float:
        """Requests that met both objectives, per second of arrivals."""
        return self.attained / self.seconds

    def as_dict(self) -> dict:
        return {**asdict(self), "goodput": round(self.goodput, 3)}


def table(results: list[Result], phases) -> str:
    names = [p.name for p in phases]
    head = ["run", "start", *names, "goodput req/s", "lost", "switches", "end"]
    rows = [head, ["---"] * len(head)]
    for r in results:
        cells = [f"{r.phases[n][1] / r.phases[n][0]:.0%} of {r.phases[n][0]}"
                 if r.phases[n][0] else "-" for n in names]
        switches = ", ".join(f"{k} x{v:g}" for k, v in sorted(r.switches.items())) or "-"
        rows.append([r.name, r.start, *cells, f"{r.goodput:.2f}", str(r.lost), switches,
                     r.end])
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def summary(results: list[Result], start: str) -> str:
    auto = results[0]
    statics = results[1:]
    first = next((r for r in statics if r.start == start), None)
    best = max(statics, key=lambda r: r.goodput) if statics else None
    parts = [f"rebalancing: {auto.goodput:.2f} req/s within objectives, {auto.lost} lost "
             f"of {auto.requests}"]
    if first is not None and first.goodput > 0:
        parts.append(f"{auto.goodput / first.goodput:.2f}x the starting split {start}")
    if best is not None and best.goodput > 0:
        parts.append(f"{auto.goodput / best.goodput:.2f}x the best static split "
                     f"({best.start}, {best.goodput:.2f} req/s)")
    return "; ".join(parts)
