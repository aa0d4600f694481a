"""Instructions per request of the gateway's own code: `loadtests.logic_cost` counted by
valgrind, a figure that does not move with the machine's speed.

    python -m loadtests.instruction_cost                          # generate, default policies
    python -m loadtests.instruction_cost --endpoint chat-stream --configs default,fixed
    python -m loadtests.instruction_cost --base /tmp/base-checkout   # A/B against a checkout

CPU time on a shared 2-core machine moves 10-30% from run to run, more than most changes to
the request path are worth, so a change judged by time alone is judged by luck. Here each
configuration runs `logic_cost` once with a small and once with a large number of requests,
each under `valgrind --tool=cachegrind --cache-sim=no` (about 40x slower, no sockets), and
the difference of the two instruction counts over the difference of requests is what one
request costs: startup, imports and warm-up cancel out. Run to run it moves about 1%.
Instructions are not time (a C-level call and a Python-level one of the same count differ),
so the socket benchmark (`loadtests.overhead`) stays the measure against the peers; this one
says whether a change to our own code made it cheaper. Needs `valgrind` on PATH.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from loadtests.logic_cost import DEFAULT_SERVERS

_REFS = re.compile(r"I\s+refs:\s+([\d,]+)")
HERE = Path(__file__).resolve().parent.parent


def instructions(tree: Path, config: str, endpoint: str, requests: int,
                 without: str = "", servers: str = DEFAULT_SERVERS, loads: bool = False) -> int:
    """Instructions of one `logic_cost` run of `requests` requests in checkout `tree`
    (`without`: mechanisms stubbed, `logic_cost --without`; `loads`: `logic_cost --loads`,
    whose polls, once a second, add about 0.1% to a run that valgrind slows 40x)."""
    command = ["valgrind", "--tool=cachegrind", "--cache-sim=no",
               "--cachegrind-out-file=/dev/null", sys.executable, "-m", "loadtests.logic_cost",
               "--rounds", "1", "--configs", config, "--endpoint", endpoint,
               "--requests", str(requests),
               *(["--servers", servers] if servers != DEFAULT_SERVERS else []),  # a base may predate it
               *(["--without", without] if without else []),
               *(["--loads"] if loads else [])]
    env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": str(tree)}
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True,
                          timeout=1800)
    found = _REFS.search(done.stderr)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"valgrind run failed ({done.returncode}): {done.stderr[-2000:]}")
    return int(found.group(1).replace(",", ""))


def per_request(tree: Path, config: str, endpoint: str, small: int, large: int,
                without: str = "", servers: str = DEFAULT_SERVERS, loads: bool = False) -> float:
    """The two runs side by side, which halves the wait on two cores: valgrind runs each
    process on one thread, and a count moves with what runs beside it only through timers
    (more of them fire in a run slowed by a shared core)."""
    with ThreadPoolExecutor(2) as pool:
        large_run, small_run = (
            pool.submit(instructions, tree, config, endpoint, n, without, servers, loads)
            for n in (large, small))
        return (large_run.result() - small_run.result()) / (large - small)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.instruction_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoint", default="generate",
                   choices=["generate", "chat", "chat-stream"])
    p.add_argument("--configs", default="default", help="of default, round_robin, fixed, floor, worker, or a stage of "
                   "loadtests/stages.py")
    p.add_argument("--small", type=int, default=640, help="requests of the short run")
    p.add_argument("--large", type=int, default=2560, help="requests of the long run")
    p.add_argument("--base", type=Path, help="another checkout, measured the same way")
    p.add_argument("--servers", default=DEFAULT_SERVERS, help="prefill and decode servers, P,D "
                   "(logic_cost --servers; 5,5 is loadtests.scaling's cluster)")
    p.add_argument("--loads", action="store_true", help="logic_cost --loads: fresh /v1/loads "
                   "snapshots, the path a deployment runs")
    args = p.parse_args(argv)
    if shutil.which("valgrind") is None:
        print("valgrind is not on PATH", file=sys.stderr)
        return 2
    small, large = (max(64, n // 64 * 64) for n in (args.small, args.large))
    if large <= small:
        p.error("--large must exceed --small by at least 64 requests")
    trees = [("this checkout", HERE)] + ([("base", args.base.resolve())] if args.base else [])
    shape = f" --servers {args.servers}" if args.servers != DEFAULT_SERVERS else ""
    shape += " --loads" if args.loads else ""
    print(f"`python -m loadtests.instruction_cost --endpoint {args.endpoint}{shape}` (instructions "
          f"per request: runs of {large} and {small} requests, differenced)\n")
    print("| configuration | " + " | ".join(name for name, _ in trees)
          + (" | this / base |" if args.base else " |"))
    print("|---|" + "---|" * (len(trees) + (1 if args.base else 0)))
    for config in [c.strip() for c in args.configs.split(",") if c.strip()]:
        counts = [per_request(tree, config, args.endpoint, small, large,
                              servers=args.servers, loads=args.loads) for _, tree in trees]
        ratio = f" {counts[0] / counts[1]:.3f}x |" if args.base else ""
        print(f"| {config} | " + " | ".join(f"{c:,.0f}" for c in counts) + " |" + ratio)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
