"""Priorities under a flood: does an interactive tenant keep its p99 while a batch tenant floods?

    python -m loadtests.priority                  # every target, about 2 minutes
    python -m loadtests.priority --duration 10    # shorter windows
    python -m loadtests.priority --targets alone,gateway,fifo --markdown out.md --out out.json

One simulated PD cluster (1 prefill + 2 decode, `backends.sim` with its H100 timing model,
`loadtests/routing/cluster.py`), then one proxy per target, each started fresh on it. The
proxy's concurrency cap (`--max-concurrency`, `--max-queue`) stands for what the servers can
run at once: beyond it requests wait in the proxy, which is where priorities act. Two tenants
from one key file (`KEY TENANT` lines): `app` sends a steady Poisson stream of interactive
requests (`x-priority: interactive`), `bulk` floods with many clients back to back
(`x-priority: batch`); both stream short /generate answers (loadtests/priority_load.py).

Targets:
  alone          our gateway, tenants and classes configured, the interactive tenant alone:
                 the baseline
  gateway        the same gateway under the flood: classes and weighted fair queueing
                 (`app` weight 4, `bulk` weight 1, capped at batch)
  gateway-equal  the same with both weights 1: classes order a tenant's own requests and
                 the shedding; across tenants the weights decide (docs/TENANCY.md)
  gateway-wfq    no classes (priority header off, default tenant settings), fair queueing
                 across the two tenants only
  fifo           priorities off: both keys are one tenant, priority header off, so one
                 first-come-first-served queue
  sglang-router  sglang-router 0.3.2 (Rust) with the same cap and queue
                 (--max-concurrent-requests, --queue-size): its FIFO queue

Per target and tenant: requests sent in the window, answered (ok), shed (429/503 from
admission; 408 from sglang-router's queue), other errors, TTFT and latency p50/p99 of the answered ones (interactive: from
the scheduled send time), and the interactive p99 relative to the alone baseline. Goal: with
priorities at most 1.5x the baseline; clearly worse without. Every process is stopped on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import orjson
import uvloop

from loadtests import peers
from loadtests.launch import HOST, free_port, running, stop_after
from loadtests.priority_load import SHED, Client, Load, drive
from loadtests.priority_report import GOAL, Row, goal_lines, markdown_table, text_table
from loadtests.routing.client import Reply
from loadtests.routing.cluster import Cluster, SimOptions, settle, sim_cluster
from loadtests.routing.report import percentile
from loadtests.routing.targets import Target as Proxy

APP = Client("app", "key-app-0123456789", "interactive")
BULK = Client("bulk", "key-bulk-0123456789", "batch")
WAIT = "gateway_tenant_queue_time_seconds"
# `app` weighs 4: enough share for its bursts (at 8 req/s it needs about 30% of the slots,
# in bursts), so its waiters go first; `gateway-equal` shows the same classes at weight 1.
TENANTS = {"app": {"priority": "interactive", "weight": 4},
           "bulk": {"priority": "batch", "max_priority": "batch", "weight": 1}}
EQUAL = {**TENANTS, "app": {"priority": "interactive", "weight": 1}}


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    flood: bool
    proxy: str  # a routing target name: how the proxy's command line is built
    shared_tenant: bool = False  # both keys are one tenant
    flags: tuple[str, ...] = ()


TARGETS = {t.name: t for t in [
    Target("alone", "our gateway, classes + WFQ; interactive alone (baseline)", False,
           "gateway:cache_aware", flags=("--tenants", orjson.dumps(TENANTS).decode())),
    Target("gateway", "our gateway, classes + WFQ; batch tenant floods", True,
           "gateway:cache_aware", flags=("--tenants", orjson.dumps(TENANTS).decode())),
    Target("gateway-equal", "as gateway, both tenants of weight 1", True,
           "gateway:cache_aware", flags=("--tenants", orjson.dumps(EQUAL).decode())),
    Target("gateway-wfq", "our gateway, WFQ across tenants only (no classes)", True,
           "gateway:cache_aware", flags=("--priority-header", "")),
    Target("fifo", "our gateway, priorities off (one tenant, one FIFO queue)", True,
           "gateway:cache_aware", shared_tenant=True, flags=("--priority-header", "")),
    Target("sglang-router", "sglang-router 0.3.2, same cap and queue (FIFO)", True,
           "sglang-router:random"),
]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtests.priority", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", default=",".join(TARGETS),
                   help=f"comma-separated, from {', '.join(TARGETS)} (default: all); "
                        "'alone' is the baseline of the ratios")
    p.add_argument("--duration", type=float, default=15.0, help="seconds of each window")
    p.add_argument("--warmup", type=float, default=3.0,
                   help="seconds the flood runs before the window opens")
    p.add_argument("--rate", type=float, default=8.0, help="interactive requests per second")
    p.add_argument("--flood", type=int, default=40, help="batch clients, back to back")
    p.add_argument("--backoff", type=float, default=0.25,
                   help="seconds a batch client waits after a 429/503 before sending again")
    p.add_argument("--tokens", type=int, default=32,
                   help="max_new_tokens of an interactive request, the mean of a batch one")
    p.add_argument("--spread", type=float, default=0.75,
                   help="batch lengths vary uniformly by this fraction of --tokens (0: all "
                        "alike, which puts the slots in lockstep)")
    p.add_argument("--max-concurrency", type=int, default=8,
                   help="requests the proxy runs at once (stands for the servers' capacity)")
    p.add_argument("--max-queue", type=int, default=32, help="requests waiting in the proxy")
    p.add_argument("--queue-timeout", type=float, default=10.0,
                   help="seconds a request may wait in the proxy's queue")
    p.add_argument("--decodes", type=int, default=2, help="decode servers (1 prefill)")
    p.add_argument("--seed", type=int, default=1, help="seed of the interactive arrivals")
    p.add_argument("--request-timeout", type=float, default=60.0,
                   help="client timeout of one request")
    peers.add_arguments(p)
    p.add_argument("--out", type=Path, help="write settings and every figure as JSON")
    p.add_argument("--markdown", type=Path, help="also write the table to this file")
    p.add_argument("--log-dir", type=Path, help="process logs (default: a temporary dir)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="give up (and clean up) after this many seconds")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.targets.split(",") if n.strip()]
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        p.error(f"unknown targets {unknown}; choose from {list(TARGETS)}")
    args.targets = [TARGETS[n] for n in names]
    return args


def key_file(log_dir: Path, shared: bool) -> Path:
    """The gateway's key file: `KEY TENANT` per line (one tenant for both keys if shared)."""
    path = log_dir / ("keys-shared" if shared else "keys")
    lines = [f"{c.key} {'shared' if shared else c.tenant}" for c in (APP, BULK)]
    path.write_text("\n".join(lines) + "\n")
    return path


def command(target: Target, cluster: Cluster, port: int, args: argparse.Namespace,
            log_dir: Path, peer_python: Path | None) -> list[str]:
    """The proxy's command line: the routing target's, plus the cap, the queue, the keys."""
    proxy = Proxy(target.proxy)
    argv = proxy.argv(cluster, port, peer_python)
    if proxy.ours:
        return argv + ["--max-concurrency", str(args.max_concurrency),
                       "--max-queue", str(args.max_queue),
                       "--queue-timeout", f"{args.queue_timeout:g}",
                       "--api-key-file", str(key_file(log_dir, target.shared_tenant)),
                       *target.flags]
    # the token bucket refills at 1/s only, so the cap is (about) a concurrency limit
    return argv + ["--max-concurrent-requests", str(args.max_concurrency),
                   "--queue-size", str(args.max_queue),
                   "--queue-timeout-secs", str(max(1, round(args.queue_timeout))),
                   "--rate-limit-tokens-per-second", "1", *target.flags]


def queue_waits(port: int) -> dict[str, float]:
    """Our gateway's own view: the mean wait of each tenant's queued requests, in ms (the
    whole run, warm-up included), from `gateway_tenant_queue_time_seconds`."""
    sums: dict[tuple[str, str], float] = {}
    text = httpx.get(f"http://{HOST}:{port}/metrics", timeout=5.0).text
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        metric = name.split("{", 1)[0]
        if metric in (f"{WAIT}_sum", f"{WAIT}_count") and 'tenant="' in name:
            tenant = name.split('tenant="', 1)[1].split('"', 1)[0]
            key = (tenant, metric.rsplit("_", 1)[1])
            sums[key] = sums.get(key, 0.0) + float(value)
    return {tenant: 1e3 * total / sums[(tenant, "count")]
            for (tenant, kind), total in sums.items()
            if kind == "sum" and sums.get((tenant, "count"))}


def row_of(target: Target, tenant: str, replies: list[Reply], window: float,
           waits: dict[str, float]) -> Row:
    ok = [r for r in replies if r.ok]
    ttfts = [r.ttft * 1e3 for r in ok if r.ttft is not None]
    latencies = [r.latency * 1e3 for r in ok]
    shed = sum(1 for r in replies if r.status in SHED)
    samples = sorted({r.error[:120] for r in replies if not r.ok and r.error
                      and r.status not in SHED})[:3]

    def pick(values: list[float], q: float) -> float:
        return percentile(values, q) if values else float("nan")

    return Row(target.name, tenant, len(replies), len(ok), shed,
               len(replies) - len(ok) - shed, len(ok) / window, pick(ttfts, 50),
               pick(ttfts, 99), pick(latencies, 50), pick(latencies, 99),
               waits.get(tenant, float("nan")), samples)


def measure(target: Target, cluster: Cluster, args: argparse.Namespace, log_dir: Path,
            peer_python: Path | None) -> list[Row]:
    settle(cluster)
    port = free_port()
    argv = command(target, cluster, port, args, log_dir, peer_python)
    ready = f"http://{HOST}:{port}{Proxy(target.proxy).ready_path}"
    with running(f"priority-{target.name}", argv, log_dir, ready, timeout=90):
        if not Proxy(target.proxy).ours:
            time.sleep(1.0)  # the peer registers its servers in background jobs
        load = Load(port, args.tokens, args.rate, args.flood if target.flood else 0,
                    args.warmup, args.duration, args.backoff, args.request_timeout, args.seed,
                    args.spread)
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            replies = runner.run(drive(load, APP, BULK))
        waits = queue_waits(port) if Proxy(target.proxy).ours else {}
    if target.shared_tenant and "shared" in waits:  # one tenant: both rows share its wait
        waits = {APP.tenant: waits["shared"], BULK.tenant: waits["shared"]}
    return [row_of(target, tenant, got, args.duration, waits)
            for tenant, got in replies.items()]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop_after(args.timeout)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="priority-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    targets = args.targets
    peer_python = None
    if any(not Proxy(t.proxy).ours for t in targets):
        try:
            peer_python = peers.peer_python(args.peers_venv, args.peers_python)
        except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
            print(f"peer unavailable, skipping it: {exc}", file=sys.stderr)
            targets = [t for t in targets if Proxy(t.proxy).ours]
    load_start = os.getloadavg()
    print(f"logs: {log_dir}; load average {load_start[0]:.2f} on {os.cpu_count()} CPUs",
          flush=True)
    rows: list[Row] = []
    started = time.monotonic()
    with sim_cluster(SimOptions(prefills=1, decodes=args.decodes), log_dir) as cluster:
        for target in targets:
            got = measure(target, cluster, args, log_dir, peer_python)
            rows += got
            print(f"[{time.monotonic() - started:5.0f}s] {target.name}: " + "; ".join(
                f"{r.tenant} {r.ok}/{r.requests} ok, {r.shed} shed, p99 "
                f"{r.latency_p99_ms:.0f} ms" for r in got), flush=True)
    signal.alarm(0)  # measured: the deadline of stop_after no longer applies
    text = text_table(rows)
    shown = " ".join(argv if argv is not None else sys.argv[1:])
    header = (f"`{f'python -m loadtests.priority {shown}'.strip()}`"
              f" ({args.duration:g} s windows, {args.rate:g} interactive req/s, "
              f"{args.flood} batch clients, cap {args.max_concurrency}, queue "
              f"{args.max_queue}, {args.tokens} tokens per request (batch +-{args.spread:g}), "
              f"1 prefill + "
              f"{args.decodes} decode sims)")
    goals = goal_lines(rows)
    print(f"\n{header}\n\n{text}\n\n" + "\n".join(goals), flush=True)
    if args.markdown:
        args.markdown.write_text(f"{header}\n\n{markdown_table(rows)}\n\n"
                                 + "\n".join(f"* {g}" for g in goals) + "\n")
    if args.out:
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                    if k != "targets"}
        settings["targets"] = [t.name for t in targets]
        args.out.write_text(json.dumps({
            "settings": settings, "goal_ratio": GOAL, "goals": goals,
            "machine": {"cpus": os.cpu_count(), "load_avg_start": load_start,
                        "load_avg_end": os.getloadavg()},
            "rows": [asdict(r) for r in rows]}, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
