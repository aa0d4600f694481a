"""Harder routing workloads (`--workload hot|docqa|agent|hard`): one cluster per workload.

Each workload gets a fresh cluster of simulated servers with its own cache size per prefill
server (`HardWorkload.sims`), sized so that the cluster holds the workload's working set and
one server does not (docs/BENCHMARKS.md, "Harder routing workloads"). Every target replays the
same seeded plan (`loadtests/routing/hard_workloads.py`); the oracle
(`loadtests/routing/oracle.py`) is measured like the proxies. Prints one table per workload and
the done-when verdicts for our default policy (`loadtests/routing/hard_report.py`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from loadtests.routing.cluster import SimOptions, sim_cluster
from loadtests.routing.hard_report import text_table, verdicts
from loadtests.routing.hard_workloads import (
    AGENT,
    AGENT_QUICK,
    DOCQA,
    DOCQA_QUICK,
    HOT,
    HOT_QUICK,
    AgentShape,
    agent_plan,
    docqa_plan,
    hot_plan,
)
from loadtests.routing.measure import measure
from loadtests.routing.report import Row
from loadtests.routing.targets import HARD, QUICK_HARD, Target, parse_targets
from loadtests.routing.workloads import ChatShape

HARD_WORKLOADS = ("hot", "docqa", "agent")
PLANS: dict[str, Callable] = {"hot": hot_plan, "docqa": docqa_plan, "agent": agent_plan}


@dataclass(frozen=True)
class HardWorkload:
    sims: SimOptions
    shape: ChatShape | AgentShape
    rate: float  # turns (agent: steps) per second, as planned
    duration: float  # seconds of arrivals per target


@dataclass(frozen=True)
class HardSetup:
    workloads: dict[str, HardWorkload]
    targets: tuple[str, ...]


FULL = HardSetup(workloads={
    # 4 x 4K prompts = 16.4K: one server cannot hold them all with the histories (16,384),
    # the cluster holds every prompt (hot one replicated) and every live history.
    "hot": HardWorkload(SimOptions(prefills=4, decodes=2, cache_tokens=16384), HOT, 70.0, 20.0),
    # 6 x 16.4K documents = 98K: a server holds two (40,960), the cluster all six.
    "docqa": HardWorkload(SimOptions(prefills=4, decodes=2, cache_tokens=40960), DOCQA, 6.0,
                          30.0),
    # ~6 live sessions of up to 18K tokens (~40K): a server holds a few (32,768), the
    # cluster all of them.
    "agent": HardWorkload(SimOptions(prefills=4, decodes=2, cache_tokens=32768), AGENT, 12.0,
                          30.0),
}, targets=tuple(HARD))
QUICK = HardSetup(workloads={
    "hot": HardWorkload(SimOptions(prefills=2, decodes=1, cache_tokens=3000), HOT_QUICK,
                        20.0, 3.0),
    "docqa": HardWorkload(SimOptions(prefills=2, decodes=1, cache_tokens=4000), DOCQA_QUICK,
                          10.0, 3.0),
    "agent": HardWorkload(SimOptions(prefills=2, decodes=1, cache_tokens=3000), AGENT_QUICK,
                          15.0, 3.0),
}, targets=tuple(QUICK_HARD))


def build_hard_setup(args: argparse.Namespace) -> HardSetup:
    """The full or quick setup with the shared flags applied to every workload."""
    setup = QUICK if args.quick else FULL
    sims_flags = {k: v for k, v in (("prefills", args.prefills), ("decodes", args.decodes),
                                    ("cache_tokens", args.cache_tokens)) if v is not None}
    workloads = {name: replace(w, sims=replace(w.sims, **sims_flags),
                               rate=args.rate or w.rate, duration=args.duration or w.duration)
                 for name, w in setup.workloads.items()}
    targets = tuple(t.name for t in parse_targets(args.targets)) if args.targets else setup.targets
    return HardSetup(workloads, targets)


def run_hard(setup: HardSetup, names: tuple[str, ...], args: argparse.Namespace, log_dir: Path,
             peer_python: Path | None, results: dict, write: Callable[[], None]) -> int:
    """Runs the named workloads for every target, prints the tables and verdicts; the number
    of errors in our gateway's rows."""
    errors = 0
    for name in names:
        work = setup.workloads[name]
        plan = PLANS[name](work.shape, work.rate, work.duration, args.seed)
        section = results["workloads"][name] = {"setup": asdict(work), "rows": [], "runs": {}}
        print(f"\n== {name}: {work.rate:g}/s planned for {work.duration:g} s per target, "
              f"{work.sims.prefills} prefill ({work.sims.cache_tokens} cache tokens each) + "
              f"{work.sims.decodes} decode", flush=True)
        rows: list[Row] = []
        with sim_cluster(work.sims, log_dir) as cluster:
            for target in (Target(t) for t in setup.targets):
                row, extra = measure(target, cluster, name, plan, work.duration, args.timeout,
                                     log_dir, peer_python)
                rows.append(row)
                section["rows"].append(row.to_dict())
                section["runs"][target.name] = extra
                errors += row.errors if target.ours else 0
                print(f"   {target.name}: {row.requests} requests, {row.errors} errors, hit "
                      f"{100 * row.hit_rate:.1f}%, TTFT p50 {row.ttft_p50_ms:.1f} ms, p90 "
                      f"{row.ttft_p90_ms:.1f} ms, prefill share {row.per_server}, load "
                      f"{extra['load1_after']:.2f}", flush=True)
                write()
        section["verdicts"] = verdicts(name, rows)
        print(f"\n{name}:\n{text_table(rows)}\n" + "\n".join(section["verdicts"]), flush=True)
        write()
    return errors
