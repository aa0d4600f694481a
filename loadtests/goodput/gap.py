"""Where a router's run falls short of the capacity DES: the same plan, side by side per kind.

    python -m loadtests.goodput.gap --timing h200-qwen2.5-32b --rate 28 --duration 20

The DES (`capacity.py`) and the simulated cluster share the physics, so on one plan their
figures differ only by what the DES leaves out (HTTP, the router's view of the servers, the
simulator's event loop) and by placement. For each request kind this prints attainment, the
misses split by cause (TTFT over its objective, ITL over its objective, refused, failed), and
TTFT and ITL percentiles of the served, for each DES placement and for the router's run on
the simulator: the line that moves first names what the bound does not see.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from backends.sim.timing import PROFILES
from loadtests import peers
from loadtests.goodput.capacity import PLACEMENTS, latency, replay
from loadtests.goodput.measure import OURS, measure
from loadtests.goodput.physics import Physics
from loadtests.goodput.run import FULL, HOT, sim_options
from loadtests.goodput.workload import KINDS, Planned, mixed_plan
from loadtests.routing.cluster import sim_cluster
from loadtests.routing.report import percentile


@dataclass(frozen=True)
class Served:
    """One request as a DES placement or a run served it (times in ms; None: not served)."""

    request: Planned
    ttft_ms: float | None
    itl_ms: float | None
    refused: bool = False

    @property
    def cause(self) -> str:
        """'met', 'ttft', 'itl', 'refused' or 'failed'."""
        if self.refused:
            return "refused"
        if self.ttft_ms is None:
            return "failed"
        if self.ttft_ms > self.request.ttft_ms:
            return "ttft"
        return "itl" if (self.itl_ms or 0.0) > self.request.itl_ms else "met"


CAUSES = ("met", "ttft", "itl", "refused", "failed")


def des_served(plan, physics: Physics, prefills: int, decodes: int,
               placement: str) -> list[Served]:
    out = []
    for job in replay(plan, prefills, decodes, physics, placement):
        seen = latency(job)
        out.append(Served(job.req, *(seen or (None, None)), refused=job.refused))
    return out


def run_served(pairs) -> list[Served]:
    return [Served(r, got.ttft * 1e3 if got.ok and got.ttft is not None else None,
                   (got.itl or 0.0) * 1e3 if got.ok else None, refused=got.refused)
            for r, got in pairs]


def rows(name: str, served: list[Served]) -> Iterable[str]:
    for kind in (*KINDS, "all"):
        mine = [s for s in served if kind in ("all", s.request.kind)]
        if not mine:
            continue
        causes = {c: sum(s.cause == c for s in mine) for c in CAUSES}
        ttft = [s.ttft_ms for s in mine if s.ttft_ms is not None]
        itl = [s.itl_ms for s in mine if s.itl_ms is not None]

        def pct(values: list[float], q: float) -> str:
            return f"{percentile(values, q):.0f}" if values else "-"

        yield (f"| {name} | {kind} | {len(mine)} | {100 * causes['met'] / len(mine):.1f}% | "
               + " | ".join(str(causes[c]) for c in CAUSES[1:])
               + f" | {pct(ttft, 50)} | {pct(ttft, 90)} | {pct(itl, 50)} | {pct(itl, 90)} |")


def timeline(name: str, served: list[Served], duration: float, width: float = 2.0) -> str:
    """Misses by arrival time, `width` seconds a column: a burst the router handled worse
    than the DES shows as columns where only its row grows."""
    counts = [0] * (int(duration / width) + 1)
    for s in served:
        if s.cause != "met":
            counts[min(int(s.request.at / width), len(counts) - 1)] += 1
    return f"| {name} | " + " | ".join(str(c) for c in counts) + " |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timing", default=Physics.timing, choices=tuple(PROFILES))
    parser.add_argument("--workload", choices=("mixed", "hot"), default="mixed")
    parser.add_argument("--rate", type=float, required=True)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", default=OURS, help="a router of loadtests.goodput")
    parser.add_argument("--timeout", type=float, default=40.0)
    peers.add_arguments(parser)
    args = parser.parse_args(argv)
    setup = HOT if args.workload == "hot" else FULL
    physics = Physics(kv_tokens=setup.kv_tokens, cache_tokens=setup.cache_tokens,
                      timing=args.timing)
    plan = mixed_plan(setup.shape, args.rate, args.duration, args.seed)
    table = ["| source | kind | sent | met | ttft | itl | refused | failed | TTFT p50 | "
             "TTFT p90 | ITL p50 | ITL p90 |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"
             "---:|---:|---:|"]
    served = {f"DES {placement}": des_served(plan, physics, setup.prefills, setup.decodes,
                                             placement) for placement in PLACEMENTS}
    with tempfile.TemporaryDirectory(prefix="goodput-gap-") as tmp:
        with sim_cluster(sim_options(setup, physics), Path(tmp)) as cluster:
            peer_python = (peers.peer_python(args.peers_venv, args.peers_python)
                           if args.target.startswith(("sglang-router", "mini-lb")) else None)
            got = measure(args.target, cluster, plan, args.timeout, Path(tmp), peer_python)
    served[args.target] = run_served(got.pairs)
    for name, each in served.items():
        table += rows(name, each)
    columns = int(args.duration / 2.0) + 1
    table += ["", "| misses by arrival | " + " | ".join(f"{2 * i}s" for i in range(columns))
              + " |", "|---|" + "---:|" * columns]
    table += [timeline(name, each, args.duration) for name, each in served.items()]
    print(f"{len(plan.requests)} requests at {args.rate:g} req/s for {args.duration:g} s, "
          f"{args.workload}, timing {physics.profile.name}; misses by cause\n")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
