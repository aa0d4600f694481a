"""Where a request's time goes at the capacity bound: `python -m loadtests.goodput.where`.

The capacity DES (capacity.py) replays the mixed plan at a few rates with each placement and
prints, per kind of request, the share that met its objectives and two means: from arrival
to its KV reaching the decode (prefill queue, compute, transfer) and from there to joining
the decode's batch (the decode's admission queue, where the first token waits). It tells
which role bounds the cluster, so which placement can still gain (docs/BENCHMARKS.md,
"Goodput").
"""

from __future__ import annotations

import argparse
from collections import defaultdict

from loadtests.goodput.capacity import PLACEMENTS, met, replay
from loadtests.goodput.physics import Physics
from loadtests.goodput.workload import HOT_CACHE_TOKENS, HOT_SHAPE, MixShape, mixed_plan


def breakdown(jobs) -> dict[str, tuple[int, float, float, float]]:
    """kind -> (requests served, share met, mean ms to the KV, mean ms in decode admission);
    `refused` -> (count, 0, 0, 0)."""
    rows: dict[str, list[tuple[float, float, bool]]] = defaultdict(list)
    refused = 0
    for job in jobs:
        if job.refused or job.first is None or job.kv_at is None:
            refused += 1
            continue
        rows[job.req.kind].append(((job.kv_at - job.req.at) * 1e3,
                                   (job.first - job.kv_at) * 1e3, met(job)))
    table = {kind: (len(v), sum(r[2] for r in v) / len(v), sum(r[0] for r in v) / len(v),
                    sum(r[1] for r in v) / len(v)) for kind, v in sorted(rows.items())}
    table["refused"] = (refused, 0.0, 0.0, 0.0)
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.goodput.where",
                                     description=__doc__)
    parser.add_argument("rates", type=float, nargs="+", help="requests/s")
    parser.add_argument("--workload", choices=("mixed", "hot"), default="mixed")
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    shape = HOT_SHAPE if args.workload == "hot" else MixShape()
    physics = Physics(cache_tokens=HOT_CACHE_TOKENS if args.workload == "hot" else 0)
    print("placement  rate  kind     served  met   to KV ms  decode admission ms")
    for placement in PLACEMENTS:
        for rate in args.rates:
            plan = mixed_plan(shape, rate, args.duration, args.seed)
            for kind, (n, share, kv, admit) in breakdown(
                    replay(plan, 2, 2, physics, placement)).items():
                print(f"{placement:9} {rate:6.1f}  {kind:8} {n:6d}  {share:4.2f}  "
                      f"{kv:8.0f}  {admit:8.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
