"""DP ranks (`--workload dp`): per-rank share and prefix-hit ratio of each router, one run.

Three layouts of the same servers, one after the other, each a fresh cluster:

1. *1 rank*: prefill servers without DP, `cache_tokens` each; multi-turn chat (the baseline).
2. *attention DP xN* (`--dp-size N --enable-dp-attention`, SGLang's check of the room's rank is
   right there): the same chat plan, then unrelated prompts. Each rank holds 1/N of the
   server's cache, so the ranks of a server together hold what the one-rank server holds.
3. *plain DP xN* (`--dp-size N`; skipped with `--no-dp-plain`): unrelated prompts. SGLang
   0.5.23 fails every room with room % N != 0 there unless the request names its rank
   (`disagg_prefill_dp_rank`), and the simulator mirrors that; a router that sends random
   rooms without the field fails about (N-1)/N of its requests, which is what its users see.

Per target and DP workload: the share of its server's requests each rank served (min/max over
every rank, the fair 1/N), the hit rate, the chat hit rate against the same target's with one
rank, errors, TTFT p50 (`loadtests/routing/dp_report.py`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from loadtests.routing.cluster import SimOptions, sim_cluster
from loadtests.routing.dp_report import (
    DpRow,
    dp_row,
    ratio_verdicts,
    share_verdicts,
    text_table,
)
from loadtests.routing.measure import measure
from loadtests.routing.report import Row
from loadtests.routing.targets import DP, QUICK_DP, Target, parse_targets
from loadtests.routing.workloads import ChatShape, UnrelatedShape, chat_plan, unrelated_plan


@dataclass(frozen=True)
class DpSetup:
    sims: SimOptions  # servers and the cache of one server; dp_ranks is set per layout
    ranks: int
    plain: bool  # also the plain-DP layout
    unrelated_on: bool  # also unrelated prompts on attention DP
    chat: ChatShape
    unrelated: UnrelatedShape
    durations: dict  # "chat", "unrelated" -> seconds of arrivals
    rates: dict  # requests per second (chat: turns per second)
    targets: tuple[str, ...]


# Half the servers of the full routing run, at half its chat rate: the same load per server.
DP_FULL = DpSetup(
    sims=SimOptions(prefills=2, decodes=2, cache_tokens=16384), ranks=4, plain=True,
    unrelated_on=True, chat=ChatShape(), unrelated=UnrelatedShape(),
    durations={"chat": 20.0, "unrelated": 12.0}, rates={"chat": 6.0, "unrelated": 20.0},
    targets=tuple(DP))
DP_QUICK = DpSetup(
    sims=SimOptions(prefills=2, decodes=1, cache_tokens=8000), ranks=4, plain=True,
    unrelated_on=True,
    chat=ChatShape(system_prompts=2, system_tokens=200, turns=(3, 5), user_tokens=(80, 160),
                   max_tokens=8, think_s=0.2),
    unrelated=UnrelatedShape(prompt_tokens=(20, 80), max_tokens=2),
    durations={"chat": 3.0, "unrelated": 10.0}, rates={"chat": 10.0, "unrelated": 25.0},
    targets=tuple(QUICK_DP))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dp-ranks", type=int,
                        help="DP ranks per prefill server of the dp workload (default 4)")
    parser.add_argument("--dp-plain", action=argparse.BooleanOptionalAction, default=True,
                        help="also run the plain-DP layout (default: on)")
    parser.add_argument("--dp-unrelated", action=argparse.BooleanOptionalAction, default=True,
                        help="also run unrelated prompts on attention DP (default: on)")


def build_dp_setup(args: argparse.Namespace) -> DpSetup:
    setup = DP_QUICK if args.quick else DP_FULL
    if args.dp_ranks is not None and args.dp_ranks < 2:
        raise ValueError(f"--dp-ranks must be >= 2, got {args.dp_ranks}")
    sims = replace(setup.sims, **{k: v for k, v in (
        ("prefills", args.prefills), ("decodes", args.decodes),
        ("cache_tokens", args.cache_tokens)) if v is not None})
    chat = setup.chat if args.system_prompts is None else replace(
        setup.chat, system_prompts=args.system_prompts)
    targets = tuple(t.name for t in parse_targets(args.targets)) if args.targets else setup.targets
    return replace(setup, sims=sims, chat=chat, ranks=args.dp_ranks or setup.ranks,
                   plain=args.dp_plain, unrelated_on=args.dp_unrelated, targets=targets,
                   durations={w: args.duration or d for w, d in setup.durations.items()},
                   rates={w: args.rate or r for w, r in setup.rates.items()})


def _phase(setup: DpSetup, sims: SimOptions, workload: str, plan, args: argparse.Namespace,
           log_dir: Path, peer_python: Path | None, cluster, runs: dict) -> dict[str, Row]:
    kind = "chat" if workload.startswith("chat") else "unrelated"
    rate, duration = setup.rates[kind], setup.durations[kind]
    print(f"\n== dp {workload} ({sims.layout}, {sims.prefills} prefill x {sims.dp_ranks} ranks, "
          f"{sims.decodes} decode): {rate:g} req/s for {duration:g} s per target", flush=True)
    rows = {}
    for name in setup.targets:
        row, extra = measure(Target(name), cluster, f"dp-{workload}", plan, duration,
                             args.timeout, log_dir, peer_python)
        rows[name] = row
        runs.setdefault(workload, {})[name] = {**extra, "row": row.to_dict()}
        print(f"   {name}: {row.requests} requests, {row.errors} errors, hit "
              f"{100 * row.hit_rate:.1f}%, TTFT p50 {row.ttft_p50_ms:.1f} ms, per rank "
              f"{row.per_rank}", flush=True)
    return rows


def run_dp(setup: DpSetup, args: argparse.Namespace, log_dir: Path, peer_python: Path | None,
           results: dict, write: Callable[[], None]) -> int:
    """Runs every layout and target, prints the tables; the errors of our gateway's rows."""
    chat = chat_plan(setup.chat, setup.rates["chat"], setup.durations["chat"], args.seed)
    unrelated = unrelated_plan(setup.unrelated, setup.rates["unrelated"],
                               setup.durations["unrelated"], args.seed)
    one = replace(setup.sims, dp_ranks=1)
    attn = replace(setup.sims, dp_ranks=setup.ranks, attn_dp=True)
    plain = replace(setup.sims, dp_ranks=setup.ranks, attn_dp=False)
    runs: dict = {}
    section = results["workloads"]["dp"] = {"setup": asdict(setup), "runs": runs}
    phases = [(one, [("chat-1rank", chat)]),
              (attn, [("chat", chat)] + [("unrelated", unrelated)] * setup.unrelated_on)]
    if setup.plain:
        phases.append((plain, [("unrelated-plain", unrelated)]))
    measured: dict[str, dict[str, Row]] = {}
    for sims, workloads in phases:
        with sim_cluster(sims, log_dir) as cluster:
            for workload, plan in workloads:
                measured[workload] = _phase(setup, sims, workload, plan, args, log_dir,
                                            peer_python, cluster, runs)
                write()
    tables = {}
    if setup.unrelated_on:
        tables["dp-unrelated"] = [dp_row(r, attn.layout, setup.ranks)
                                  for r in measured["unrelated"].values()]
    tables["dp-chat"] = [dp_row(r, attn.layout, setup.ranks, measured["chat-1rank"][name])
                         for name, r in measured["chat"].items()]
    if setup.plain:
        tables["dp-unrelated-plain"] = [dp_row(r, plain.layout, setup.ranks)
                                        for r in measured["unrelated-plain"].values()]
    for name, rows in tables.items():
        verdicts = ratio_verdicts(rows) if name == "dp-chat" else share_verdicts(rows)
        print(f"\n{name}:\n{text_table(rows)}\n" + "\n".join(verdicts), flush=True)
        section[name] = {"rows": [r.to_dict() for r in rows], "verdicts": verdicts}
    write()
    return sum(r.errors for rows in tables.values() for r in rows
               if r.target.startswith("gateway:"))


def dp_rows(section: dict, name: str) -> list[DpRow]:
    """The rows of one DP table back from `--out` JSON (for tests and docs)."""
    fields = set(DpRow.__dataclass_fields__)
    return [DpRow(**{k: v for k, v in row.items() if k in fields})
            for row in section[name]["rows"]]
