"""One router at one rate: start it, replay the plan open-loop, and read the gateway's counters.

The cluster is settled first (no work, caches flushed, counters reset: `routing.cluster.settle`)
and the router is started fresh for every rate, so no rate inherits another's learned state
or prefix tree. Every request is sent at its planned time whatever the answers do (open loop)
with its objectives as `x-slo-ttft-ms` / `x-slo-itl-ms` headers; the peers ignore them.

Our gateway's Prometheus counters (`/metrics`) are read before and after the replay; the
deltas of the series in `WATCHED` are kept. What "cut for waiting" counts: attempts stopped by
a deadline and retried (`gateway_retries_total` with reason `timeout`, the first-progress
deadline's expiry, or `rescued`, stopped as a suspected hang) and requests answered 504
(`gateway_requests_total{status="504"}`).
"""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvloop

from loadtests import procstat
from loadtests.goodput.client import Outcome, send
from loadtests.goodput.workload import Plan, Planned
from loadtests.routing.cluster import Cluster, settle, snapshot
from loadtests.routing.measure import endpoint
from loadtests.routing.targets import Target

OURS = "gateway"  # our gateway with its defaults: no policy flags
WATCHED = ("gateway_retries_total", "gateway_requests_total",
           "gateway_admission_rejections_total", "gateway_upstream_failures_total",
           "gateway_stream_failovers_total", "gateway_slo_requests_total",
           # the SLO model's forecast error (observed / predicted): sum over count is its mean
           "gateway_slo_prediction_error_sum", "gateway_slo_prediction_error_count")
CUT_REASONS = ('reason="timeout"', 'reason="rescued"')


@dataclass(frozen=True)
class Defaults:
    """Our gateway as a user starts it: the servers, nothing else (duck-types `Target` for
    `routing.measure.endpoint`)."""

    name: str = OURS
    proxy: bool = True
    ready_path: str = "/readiness"
    ours: bool = True
    peer: bool = False

    def argv(self, cluster: Cluster, port: int, peer_python: Path | None) -> list[str]:
        args = [sys.executable, "-m", "gateway", "--host", "127.0.0.1", "--port", str(port),
                "--log-level", "warning"]
        for server in cluster.prefills:
            args += ["--prefill", server.url, str(server.bootstrap_port)]
        for server in cluster.decodes:
            args += ["--decode", server.url]
        # a candidate default, measured as "ours" before it ships (e.g. "--policy slo")
        return args + shlex.split(os.environ.get("GOODPUT_GATEWAY_ARGS", ""))


def target_of(name: str) -> Defaults | Target:
    return Defaults() if name == OURS else Target(name)


def scrape(port: int) -> dict[str, float]:
    """The watched series of the gateway's /metrics, by their full name with labels."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10.0).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        series, value = line.rsplit(" ", 1)
        if series.split("{", 1)[0] in WATCHED:
            out[series] = float(value)
    return out


def deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in sorted(after.items())
            if v - before.get(k, 0.0) != 0}


def cut_for_waiting(changes: dict[str, float]) -> int:
    retried = sum(v for k, v in changes.items() if k.startswith("gateway_retries_total")
                  and any(r in k for r in CUT_REASONS))
    timed_out = sum(v for k, v in changes.items() if k.startswith("gateway_requests_total")
                    and 'status="504"' in k)
    return int(retried + timed_out)


async def _one(port: int, path: str, request: Planned, start: float, timeout: float,
               out: list[tuple[Planned, Outcome]]) -> None:
    delay = start + request.at - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    out.append((request, await send(port, path, request.body(), request.headers(), timeout)))


async def _replay(port: int, plan: Plan, timeout: float) -> tuple[list, float]:
    out: list[tuple[Planned, Outcome]] = []
    start = time.perf_counter() + 0.05
    await asyncio.gather(*(_one(port, plan.path, r, start, timeout, out)
                           for r in plan.requests))
    return out, time.perf_counter() - start


@dataclass(frozen=True)
class Run:
    pairs: list[tuple[Planned, Outcome]]  # every request with its outcome
    elapsed: float  # from the first send to the last answer
    metrics: dict[str, float]  # deltas of our gateway's watched series ({} for peers)
    argv: list[str]
    # cores busy over the run: the busiest simulated server (near 1.0 its steps run late,
    # which no router can help) and the router's process tree
    busiest_server_cores: float = 0.0
    proxy_cores: float = 0.0
    prefill_legs: int = 0  # generation requests the prefill servers received (retries too)


def _cpu(pids: list[int | None]) -> list[float]:
    return [procstat.cpu_seconds(p) if p else 0.0 for p in pids]


def measure(name: str, cluster: Cluster, plan: Plan, timeout: float, log_dir: Path,
            peer_python: Path | None, warmup: Plan | None = None) -> Run:
    """`plan` through router `name` on a rested cluster with flushed caches, after `warmup`
    (answered in full, not measured: workload.warmup_plan)."""
    settle(cluster, timeout=60.0)  # TimeoutError: a router left work behind
    target = target_of(name)
    label = f"goodput-{plan.rate:g}"
    with endpoint(target, cluster, label, plan, timeout, log_dir, peer_python) as ep, \
            asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        legs_before = 0
        if warmup is not None:
            runner.run(_replay(ep.port, warmup, timeout))
            legs_before = sum(snapshot(cluster).requests.values())
        before = scrape(ep.port) if target.ours and ep.port else {}
        pids = [ep.pid, *cluster.pids]
        cpu = _cpu(pids)
        pairs, elapsed = runner.run(_replay(ep.port, plan, timeout))
        busy = [(b - a) / elapsed for a, b in zip(cpu, _cpu(pids), strict=True)]
        after = scrape(ep.port) if target.ours and ep.port else {}
    legs = sum(snapshot(cluster).requests.values()) - legs_before  # since the settle's reset
    return Run(pairs, elapsed, deltas(before, after), ep.argv, max(busy[1:]), busy[0], legs)
