"""The long compound-fault soak: `python -m loadtests.soak --seeds 1,2,3 --minutes 10`.

Each seed runs the harness of tests/reliability/soak/ (a real gateway with its default flags
over 2 prefill + 3 decode sims, overlapping faults, mixed traffic, every answer checked) in
a fresh rig, prints its report and its slowest answers with the faults around them, and at
the end a table: seed, minutes, requests, faults by kind, failures by kind, worst latency.
Exit status 1 if any seed failed. `--seed N` with the `--seconds` a report names replays
that run's schedule exactly.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from tests.reliability.soak.report import LINGER, SoakResult, table
from tests.reliability.soak.runner import SoakOptions, run_soak


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtests.soak", description=__doc__)
    parser.add_argument("--seeds", default="1", help="comma-separated seeds, e.g. 1,2,3")
    parser.add_argument("--seed", type=int, help="one seed (replays a reported run)")
    parser.add_argument("--minutes", type=float, default=10.0, help="length of each run")
    parser.add_argument("--seconds", type=float, help="length of each run, overrides --minutes")
    parser.add_argument("--rate", type=float, default=SoakOptions.rate, help="requests/s")
    parser.add_argument("--concurrency", type=int, default=SoakOptions.concurrency)
    parser.add_argument("--log-dir", type=Path, help="keep the processes' logs here")
    parser.add_argument("--no-faults", action="store_true",
                        help="the same traffic with no fault: a control run of the harness")
    parser.add_argument("--gateway-arg", action="append", default=[], metavar="ARG",
                        help="extra gateway flag (repeat; default: the gateway's defaults)")
    return parser.parse_args(argv)


SLOWEST = 5  # the slowest answers listed per run, failed or not


def slowest(result: SoakResult) -> str:
    """The run's slowest answers, each with the faults around it (active, or ended less than
    `LINGER` s before it started): where to look first in the gateway's log."""
    lines = ["  slowest:"]
    for o in sorted(result.outcomes, key=lambda o: -o.latency)[:SLOWEST]:
        around = result.schedule.active(o.start, o.start + o.latency, LINGER)
        faults = ", ".join(f.label() for f in around) or "none"
        lines.append(f"    t={o.start:.1f}s {o.kind} {o.latency:.1f}s status={o.status}"
                     f"{' ' + o.failure[0] if o.failure else ''} | faults: {faults}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    seeds = [args.seed] if args.seed is not None else [int(s) for s in args.seeds.split(",")]
    seconds = args.seconds if args.seconds is not None else args.minutes * 60
    options = SoakOptions(seconds=seconds, rate=args.rate, concurrency=args.concurrency,
                          gateway_args=tuple(args.gateway_arg), faults=not args.no_faults)
    results = []
    for seed in seeds:
        log_dir = args.log_dir / f"seed{seed}" if args.log_dir else Path(
            tempfile.mkdtemp(prefix=f"soak-seed{seed}-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        result = run_soak(seed, log_dir, options)
        results.append(result)
        print(result.render(), slowest(result), f"\n  logs: {log_dir}\n", sep="\n",
              flush=True)
    print(table(results))
    return 1 if any(r.failures or r.executor_errors for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
