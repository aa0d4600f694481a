"""Where a request's instructions go: the gateway's per-request mechanisms, each replaced by
nothing in turn (loadtests/mechanisms.py), the policies (`fixed`), and the least a Python PD
proxy does in the same harness (`floor`: loadtests/pd_floor.py, its upstream in memory).

    python -m loadtests.mechanism_cost                    # /generate, about 10 minutes
    python -m loadtests.mechanism_cost --endpoint chat
    python -m loadtests.mechanism_cost --config worker --only shared_prefixes,shared_loads

Each row is `instruction_cost`'s figure (valgrind, runs of two lengths differenced) for
`logic_cost` with that change; "saved" is the default's count less the row's. A stub's saving
is an upper bound of what making its mechanism cheaper could give (it drops what the mechanism
is for). `--config worker` runs the rows as worker 0 of `--workers 8` (loadtests/worker_mode.py),
where the workers' own mechanisms (`shared_prefixes`, `shared_loads`) run; in the default
configuration they do nothing. Needs `valgrind` on PATH.
"""

from __future__ import annotations

import argparse
import shutil
import sys

from loadtests import instruction_cost, mechanisms


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.mechanism_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoint", default="generate", choices=["generate", "chat"])
    p.add_argument("--small", type=int, default=640)
    p.add_argument("--large", type=int, default=2560)
    p.add_argument("--only", default="all", help="the mechanisms to stub, one row each")
    p.add_argument("--config", default="default", choices=["default", "worker"],
                   help="the configuration the rows run in (worker: as one of --workers 8)")
    p.add_argument("--servers", default=instruction_cost.DEFAULT_SERVERS,
                   help="prefill and decode servers, P,D (logic_cost --servers)")
    args = p.parse_args(argv)
    if shutil.which("valgrind") is None:
        print("valgrind is not on PATH", file=sys.stderr)
        return 2
    tree = instruction_cost.HERE
    small, large = (max(64, n // 64 * 64) for n in (args.small, args.large))

    def count(config: str, without: str = "") -> float:
        return instruction_cost.per_request(tree, config, args.endpoint, small, large, without,
                                            args.servers)

    chosen = mechanisms.names(args.only)
    config = args.config
    rows = [(f"without {name}: {mechanisms.STUBS[name][0]}", count(config, name))
            for name in chosen]
    if len(chosen) > 1:  # with one, the same run as its own row
        rows.append((f"without all {len(chosen)} at once", count(config, ",".join(chosen))))
    if config == "default":  # these two are single-process configurations
        rows.append(("policies replaced by a fixed alternation (`fixed`)", count("fixed")))
        rows.append(("the floor: a PD proxy's least work, same harness (`floor`)",
                     count("floor")))
    default = count(config)
    shape = f" --servers {args.servers}" if args.servers != instruction_cost.DEFAULT_SERVERS else ""
    print(f"`python -m loadtests.mechanism_cost --endpoint {args.endpoint} --config {config}"
          f"{shape}` "
          f"(instructions per request, default policies; runs of {large} and {small} "
          "requests, differenced)\n")
    print(f"| the {config} less | instructions per request | saved | share of the {config} |")
    print("|---|---|---|---|")
    print(f"| nothing (the {config}) | {default:,.0f} | - | - |")
    for label, figure in rows:
        saved = default - figure
        print(f"| {label} | {figure:,.0f} | {saved:,.0f} | {saved / default:.1%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
