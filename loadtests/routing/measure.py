"""One target measured on one workload: start the proxy, replay the plan, read the servers.

The cluster is settled first (no work, caches flushed, counters reset); the figures are the
deltas of the prefill servers' counters over the replay, the client's samples, the CPU time of
the proxy and of everything else, and for our gateway its own view (`/metrics`): the prefill
decisions per server (a DP rank is `url#dpR`), the hits it predicted, its retries. The oracle
has no proxy: the load generator routes (its CPU counts as the load generator's).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import uvloop

from loadtests import procstat
from loadtests.launch import free_port, running
from loadtests.routing.cluster import Cluster, difference, settle, snapshot
from loadtests.routing.drive import (
    Drive,
    Send,
    drive_agent,
    drive_chat,
    drive_fewshot,
    via_proxy,
)
from loadtests.routing.hard_workloads import AgentPlan
from loadtests.routing.oracle import Oracle
from loadtests.routing.report import Row, make_row
from loadtests.routing.targets import Target
from loadtests.routing.workloads import ChatPlan


def gateway_view(port: int) -> dict:
    """What our gateway saw: prefill decisions per server, predicted and reported hits, retries."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5.0).text
    sums: dict[str, float] = {}
    decisions: dict[str, float] = {}
    ranks: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        metric = name.split("{", 1)[0]
        sums[metric] = sums.get(metric, 0.0) + float(value)
        if metric == "gateway_routing_decisions_total" and 'role="prefill"' in name:
            server = name.split('server="', 1)[1].split('"', 1)[0]
            decisions[server] = float(value)
        elif metric == "gateway_dp_rank_requests_total":
            server = name.split('server="', 1)[1].split('"', 1)[0]
            rank = name.split('rank="', 1)[1].split('"', 1)[0]
            ranks[f"{server}#dp{rank}"] = float(value)
    prompt = sums.get("gateway_prompt_tokens_total", 0.0) or 1.0
    return {
        "prefill_decisions": decisions,
        "rank_requests": ranks,
        "predicted_hit_rate": sums.get("gateway_predicted_cached_tokens_total", 0.0) / prompt,
        "reported_hit_rate": sums.get("gateway_cached_tokens_total", 0.0) / prompt,
        "retries": sums.get("gateway_retries_total", 0.0),
    }


def run_drive(send: Send, plan, duration: float) -> Drive:
    if isinstance(plan, ChatPlan):
        drive = drive_chat
    elif isinstance(plan, AgentPlan):
        drive = drive_agent
    else:
        drive = drive_fewshot
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(drive(send, plan, duration))


@dataclass(frozen=True)
class Endpoint:
    """Where a target's requests go: its sender, and its proxy process if it has one."""

    send: Send
    pid: int | None = None
    port: int | None = None
    argv: list[str] = field(default_factory=list)


@contextlib.contextmanager
def endpoint(target: Target, cluster: Cluster, workload: str, plan, timeout: float,
             log_dir: Path, peer_python: Path | None) -> Iterator[Endpoint]:
    """The target ready to take requests: its proxy started (and stopped after), or the
    oracle built from the plan."""
    if not target.proxy:
        yield Endpoint(Oracle(cluster, plan, timeout).send)
        return
    port = free_port()
    argv = target.argv(cluster, port, peer_python)
    with running(f"{workload}-{target.name.replace(':', '-')}", argv, log_dir,
                 f"http://127.0.0.1:{port}{target.ready_path}") as proxy:
        time.sleep(1.0)  # peers register servers in background jobs after readiness
        yield Endpoint(via_proxy(port, timeout), proxy.pid, port, argv)


def measure(target: Target, cluster: Cluster, workload: str, plan, duration: float,
            timeout: float, log_dir: Path, peer_python: Path | None) -> tuple[Row, dict]:
    settle(cluster)
    load_before = os.getloadavg()[0]
    with endpoint(target, cluster, workload, plan, timeout, log_dir, peer_python) as ep:
        before = snapshot(cluster)
        meter = procstat.WindowMeter(ep.pid, cluster.pids)
        meter.start()
        started = time.monotonic()
        drive = run_drive(ep.send, plan, duration)
        usage = meter.stop()
        window = time.monotonic() - started
        after = snapshot(cluster)
        policy = gateway_view(ep.port) if target.ours and ep.port else {}
    row = make_row(target.name, drive, difference(before, after), usage, window, policy)
    extra = {"argv": ep.argv, "load1_before": load_before, "load1_after": os.getloadavg()[0],
             "cpu_s": {"proxy": usage.proxy, "servers": usage.backends,
                       "loadgen": usage.loadgen, "other": usage.other}}
    return row, extra
