"""Routing-quality benchmark: cache hit rate and TTFT of PD routers on the same simulated servers.

    python -m loadtests.routing                      # full run: 4 prefill + 4 decode, all targets
    python -m loadtests.routing --quick              # CI-sized: 2 + 1 servers, two of our policies
    python -m loadtests.routing --workload chat \
        --targets gateway:cache_aware,sglang-router:cache_aware --duration 20

Workloads (`loadtests/routing_workloads.py`): multi-turn chat with a few shared long system
prompts and growing per-conversation histories, and few-shot prompts with short questions.
Servers (`loadtests/routing_cluster.py`): simulated SGLang with the H100 timing model and a
finite LRU prefix cache per prefill server, sized so that one server cannot hold every
conversation but the cluster can. Targets (`loadtests/routing_targets.py`): our gateway per
prefill policy, sglang-router 0.3.2 per policy, mini_lb. Every target replays the same plan
against the same servers, whose caches are flushed and counters reset in between.

Prints one table per workload and the margin of our best policy over sglang-router's
cache_aware; `--out` writes every figure as JSON. Every process started here is stopped on exit
(also on SIGTERM); everything listens on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

if __package__ in (None, ""):  # `python loadtests/routing.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import uvloop  # noqa: E402

from loadtests import peers, procstat  # noqa: E402
from loadtests.launch import free_port, running  # noqa: E402
from loadtests.routing_cluster import (  # noqa: E402
    Cluster,
    SimOptions,
    difference,
    settle,
    sim_cluster,
    snapshot,
)
from loadtests.routing_drive import Drive, drive_chat, drive_fewshot  # noqa: E402
from loadtests.routing_report import Row, make_row, margin, text_table  # noqa: E402
from loadtests.routing_targets import ALL, QUICK, Target, parse_targets  # noqa: E402
from loadtests.routing_workloads import (  # noqa: E402
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
    parser.add_argument("--workload", choices=("chat", "fewshot", "both"), default="both")
    parser.add_argument("--targets", help=f"comma-separated, from: {', '.join(ALL)}")
    parser.add_argument("--duration", type=float,
                        help="seconds of arrivals per workload and target (default: chat 40, "
                             "fewshot 20; quick 6 and 3)")
    parser.add_argument("--rate", type=float,
                        help="requests per second (chat: turns per second; default: chat 12, "
                             "fewshot 16; quick 10)")
    parser.add_argument("--prefills", type=int, help="prefill servers (default 4; quick 2)")
    parser.add_argument("--decodes", type=int, help="decode servers (default 4; quick 1)")
    parser.add_argument("--cache-tokens", type=int,
                        help="prefix cache per prefill server, tokens (default 16384; quick 2500)")
    parser.add_argument("--system-prompts", type=int,
                        help="shared system prompts of the chat workload (default 4; quick 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--log-dir", type=Path, help="process logs (default: a temporary dir)")
    parser.add_argument("--peers-venv", type=Path, default=peers.DEFAULT_VENV,
                        help="venv with sglang-router 0.3.2 (created if missing)")
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


def _gateway_view(port: int) -> dict:
    """What our gateway saw: prefill decisions per worker, predicted and reported hits, retries."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5.0).text
    sums: dict[str, float] = {}
    decisions: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        metric = name.split("{", 1)[0]
        sums[metric] = sums.get(metric, 0.0) + float(value)
        if metric == "gateway_routing_decisions_total" and 'role="prefill"' in name:
            worker = name.split('worker="', 1)[1].split('"', 1)[0]
            decisions[worker] = float(value)
    prompt = sums.get("gateway_prompt_tokens_total", 0.0) or 1.0
    return {
        "prefill_decisions": decisions,
        "predicted_hit_rate": sums.get("gateway_predicted_cached_tokens_total", 0.0) / prompt,
        "reported_hit_rate": sums.get("gateway_cached_tokens_total", 0.0) / prompt,
        "retries": sums.get("gateway_retries_total", 0.0),
    }


def _run_drive(workload: str, port: int, plan, duration: float, timeout: float) -> Drive:
    drive = drive_chat if workload == "chat" else drive_fewshot
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(drive(port, plan, duration, timeout))


def measure(target: Target, cluster: Cluster, workload: str, plan, setup: Setup,
            args: argparse.Namespace, log_dir: Path, peer_python: Path | None) -> tuple[Row, dict]:
    settle(cluster)
    port = free_port()
    argv = target.argv(cluster, port, peer_python)
    load_before = os.getloadavg()[0]
    with running(f"{workload}-{target.name.replace(':', '-')}", argv, log_dir,
                 f"http://127.0.0.1:{port}{target.ready_path}") as proxy:
        time.sleep(1.0)  # peers register workers in background jobs after readiness
        before = snapshot(cluster)
        meter = procstat.WindowMeter(proxy.pid, cluster.pids)
        meter.start()
        started = time.monotonic()
        drive = _run_drive(workload, port, plan, setup.durations[workload], args.timeout)
        usage = meter.stop()
        window = time.monotonic() - started
        after = snapshot(cluster)
        policy = _gateway_view(port) if target.ours else {}
    row = make_row(target.name, drive, difference(before, after), usage, window, policy)
    extra = {"argv": argv, "load1_before": load_before, "load1_after": os.getloadavg()[0],
             "cpu_s": {"proxy": usage.proxy, "servers": usage.backends,
                       "loadgen": usage.loadgen, "other": usage.other}}
    return row, extra


def _on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        setup = build_setup(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _on_sigterm)
    targets = [Target(n) for n in setup.targets]
    workloads = WORKLOADS if args.workload == "both" else (args.workload,)
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
        cluster = stack.enter_context(sim_cluster(setup.sims, log_dir))
        for workload in workloads:
            rate, duration = setup.rates[workload], setup.durations[workload]
            plan = (chat_plan(setup.chat, rate, duration, args.seed) if workload == "chat"
                    else fewshot_plan(setup.fewshot, rate, duration, args.seed))
            print(f"\n== {workload}: {rate:g} req/s for {duration:g} s per target", flush=True)
            rows, extras = [], {}
            for target in targets:
                row, extra = measure(target, cluster, workload, plan, setup, args, log_dir,
                                     peer_python)
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
    results["machine"]["load_avg_end"] = os.getloadavg()
    _write(args.out, results)
    errors = sum(r["errors"] for w in results["workloads"].values() for r in w["rows"])
    return 1 if errors else 0


def _write(path: Path | None, results: dict) -> None:
    if path is not None:
        path.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
