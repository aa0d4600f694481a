"""Routing-quality benchmark: cache hit rate and TTFT of PD routers on the same simulated servers.

    python -m loadtests.routing                      # full run: 4 prefill + 4 decode, all targets
    python -m loadtests.routing --quick              # CI-sized: 2 + 1 servers, two of our policies
    python -m loadtests.routing --workload chat \
        --targets gateway:cache_aware,sglang-router:cache_aware --duration 20
    python -m loadtests.routing --workload dp         # prefills with 4 DP ranks, ~7 min
    python -m loadtests.routing --workload dp --quick # CI-sized, our gateway only
    python -m loadtests.routing --workload hard       # hot prompt, docqa, agents; ~13 min
    python -m loadtests.routing --workload hard --quick  # CI-sized, with the oracle

Workloads (`loadtests/routing/workloads.py`): multi-turn chat with a few shared long system
prompts and growing per-conversation histories, and few-shot prompts with short questions.
Servers (`loadtests/routing/cluster.py`): simulated SGLang with the H100 timing model and a
finite LRU prefix cache per prefill server, sized so that one server cannot hold every
conversation but the cluster can. Targets (`loadtests/routing/targets.py`): our gateway per
prefill policy, sglang-router 0.3.2 per policy, mini_lb. Every target replays the same plan
against the same servers, whose caches are flushed and counters reset in between.
`--workload dp` (`loadtests/routing/dp.py`): prefills with DP ranks, per-rank share of
unrelated prompts and the chat hit rate against one rank per server with the same cache.
`--workload hot|docqa|agent|hard` (`loadtests/routing/hard.py`): one hot system prompt on 70%
of the turns, questions about a few 16K documents, agent loops with growing contexts (hard:
all three), each on a cluster sized for it, with the sticky oracle as the reference; not
part of `both` (it would double the full run's time).

Prints one table per workload and the margin of our best policy over sglang-router's
cache_aware; `--out` writes every figure as JSON. Every process started here is stopped on exit
(also on SIGTERM); everything listens on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

if __package__ in (None, ""):  # `python loadtests/routing/run.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loadtests import peers  # noqa: E402
from loadtests.routing.cluster import SimOptions, sim_cluster  # noqa: E402
from loadtests.routing.dp import add_arguments, build_dp_setup, run_dp  # noqa: E402
from loadtests.routing.hard import HARD_WORKLOADS, build_hard_setup, run_hard  # noqa: E402
from loadtests.routing.measure import measure  # noqa: E402
from loadtests.routing.report import margin, text_table  # noqa: E402
from loadtests.routing.targets import ALL, KNOWN, QUICK, Target, parse_targets  # noqa: E402
from loadtests.routing.workloads import (  # noqa: E402
    ChatShape,
    FewshotShape,
    chat_plan,
    fewshot_plan,
)

WORKLOADS = ("chat", "fewshot")


@dataclass(frozen=True)
class Setup:
    """Everything a run is made of; `--quick` swaps in a smaller one."""

    sims: SimOptions
    chat: ChatShape
    fewshot: FewshotShape
    durations: dict  # workload -> seconds of arrivals
    rates: dict  # workload -> requests per second (chat: turns per second)
    targets: tuple[str, ...]


FULL = Setup(
    sims=SimOptions(prefills=4, decodes=4, cache_tokens=16384),
    chat=ChatShape(),
    fewshot=FewshotShape(),
    durations={"chat": 40.0, "fewshot": 20.0},
    rates={"chat": 12.0, "fewshot": 16.0},
    targets=tuple(ALL),
)
QUICK_SETUP = Setup(
    sims=SimOptions(prefills=2, decodes=1, cache_tokens=2500),
    chat=ChatShape(system_prompts=2, system_tokens=200, turns=(5, 8), user_tokens=(80, 160),
                   max_tokens=16, think_s=0.2),
    fewshot=FewshotShape(prefixes=4, prefix_tokens=400, max_tokens=8),
    durations={"chat": 6.0, "fewshot": 3.0},
    rates={"chat": 10.0, "fewshot": 10.0},
    targets=tuple(QUICK),
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.routing", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="CI-sized: 2 prefill + 1 decode, a few seconds per target, "
                             f"targets {','.join(QUICK)}")
    parser.add_argument("--workload", "--workloads",
                        choices=("chat", "fewshot", "both", "dp", *HARD_WORKLOADS, "hard"),
                        default="both",
                        help="both: chat and fewshot; dp: prefills with DP ranks (per-rank "
                             "share, hit ratio against one rank; see loadtests/routing/dp.py); "
                             "hot, docqa, agent, hard (all three): the harder workloads with "
                             "the sticky oracle (loadtests/routing/hard.py)")
    parser.add_argument("--targets", help=f"comma-separated, from: {', '.join(KNOWN)}")
    parser.add_argument("--duration", type=float,
                        help="seconds of arrivals per workload and target (default: chat 40, "
                             "fewshot 20; quick 6 and 3; dp: chat 20, unrelated 12; hot 20, "
                             "docqa and agent 30, quick 3)")
    parser.add_argument("--rate", type=float,
                        help="requests per second (chat: turns per second; default: chat 12, "
                             "fewshot 16; quick 10; dp: chat 6, unrelated 20; hot 70, docqa 6, "
                             "agent 12 steps/s)")
    parser.add_argument("--prefills", type=int,
                        help="prefill servers (default 4; quick 2; dp 2; hard 4)")
    parser.add_argument("--decodes", type=int,
                        help="decode servers (default 4; quick 1; dp 2; hard 2)")
    parser.add_argument("--cache-tokens", type=int,
                        help="prefix cache per prefill server, tokens, split over its DP ranks "
                             "(default 16384; quick 2500; dp 16384, dp quick 8000; hot 16384, "
                             "docqa 40960, agent 32768)")
    parser.add_argument("--system-prompts", type=int,
                        help="shared system prompts of the chat workload (default 4; quick 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--log-dir", type=Path, help="process logs (default: a temporary dir)")
    parser.add_argument("--peers-venv", type=Path, default=peers.DEFAULT_VENV,
                        help="venv with sglang-router 0.3.2 (created if missing)")
    add_arguments(parser)
    return parser.parse_args(argv)


def build_setup(args: argparse.Namespace) -> Setup:
    setup = QUICK_SETUP if args.quick else FULL
    for name in ("prefills", "decodes", "cache_tokens", "system_prompts", "duration", "rate"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    sims = replace(setup.sims, **{k: v for k, v in (
        ("prefills", args.prefills), ("decodes", args.decodes),
        ("cache_tokens", args.cache_tokens)) if v is not None})
    chat = setup.chat if args.system_prompts is None else replace(
        setup.chat, system_prompts=args.system_prompts)
    durations = {w: args.duration or d for w, d in setup.durations.items()}
    rates = {w: args.rate or r for w, r in setup.rates.items()}
    targets = tuple(t.name for t in parse_targets(args.targets)) if args.targets else setup.targets
    return replace(setup, sims=sims, chat=chat, durations=durations, rates=rates,
                   targets=targets)


def _on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dp = args.workload == "dp"
    hard = HARD_WORKLOADS if args.workload == "hard" else tuple(
        w for w in HARD_WORKLOADS if w == args.workload)
    try:
        setup = (build_dp_setup(args) if dp else build_hard_setup(args) if hard
                 else build_setup(args))
        if dp or hard:
            build_setup(args)  # the shared flags' checks
        if dp and "oracle" in setup.targets:
            raise ValueError("the oracle has no DP-rank steering: not a dp target")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _on_sigterm)
    targets = [Target(n) for n in setup.targets]
    peer_python = peers.ensure_venv(args.peers_venv) if any(t.peer for t in targets) else None
    results: dict = {
        "command": "python -m loadtests.routing " + shlex.join(argv or sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "load_avg_start": os.getloadavg()},
        "setup": asdict(setup), "workloads": {},
    }
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
          f"on {os.cpu_count()} CPUs", flush=True)
    with contextlib.ExitStack() as stack:
        log_dir = args.log_dir or Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="routing-")))
        log_dir.mkdir(parents=True, exist_ok=True)
        if dp:
            errors = run_dp(setup, args, log_dir, peer_python, results,
                            lambda: _write(args.out, results))
        elif hard:
            errors = run_hard(setup, hard, args, log_dir, peer_python, results,
                              lambda: _write(args.out, results))
        else:
            workloads = WORKLOADS if args.workload == "both" else (args.workload,)
            _run_workloads(setup, workloads, targets, args, log_dir, peer_python, results)
            errors = sum(r["errors"] for w in results["workloads"].values() for r in w["rows"])
    results["machine"]["load_avg_end"] = os.getloadavg()
    _write(args.out, results)
    return 1 if errors else 0


def _run_workloads(setup: Setup, workloads: tuple[str, ...], targets: list[Target],
                   args: argparse.Namespace, log_dir: Path, peer_python: Path | None,
                   results: dict) -> None:
    with sim_cluster(setup.sims, log_dir) as cluster:
        for workload in workloads:
            rate, duration = setup.rates[workload], setup.durations[workload]
            plan = (chat_plan(setup.chat, rate, duration, args.seed) if workload == "chat"
                    else fewshot_plan(setup.fewshot, rate, duration, args.seed))
            print(f"\n== {workload}: {rate:g} req/s for {duration:g} s per target", flush=True)
            rows, extras = [], {}
            for target in targets:
                row, extra = measure(target, cluster, workload, plan, duration, args.timeout,
                                     log_dir, peer_python)
                rows.append(row)
                extras[target.name] = extra
                print(f"   {target.name}: {row.requests} requests, {row.errors} errors, hit "
                      f"{100 * row.hit_rate:.1f}%, TTFT p50 {row.ttft_p50_ms:.1f} ms, "
                      f"cores busy {row.own_cores:.2f} ours, {row.busy_cores:.2f} all, load "
                      f"{extra['load1_after']:.2f}",
                      flush=True)
                results["workloads"][workload] = {
                    "rows": [r.to_dict() for r in rows], "runs": extras}
                _write(args.out, results)
            print(f"\n{workload}:\n{text_table(rows)}\n{margin(rows)}", flush=True)
            results["workloads"][workload]["margin"] = margin(rows)


def _write(path: Path | None, results: dict) -> None:
    if path is not None:
        path.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
