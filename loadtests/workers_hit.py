"""Hit ratio with `--workers N` when every turn of a conversation comes on a new connection.

    python -m loadtests.workers_hit                          # 24 chats x 6 turns, 1 vs 2 workers
    python -m loadtests.workers_hit --workers 1,2,4 --seeds 0,1,2 --cache-tokens 8192

The case a new user tried (issue 24): 24 chats of 6 turns over 2 prefill servers with small
prompt caches (`backends.sim`, LRU, `--cache-tokens` each) and 1 decode; each turn is sent
after the previous reply (plus a short think time) on a connection of its own, so the kernel
hands the turns of one conversation to any of the gateway's worker processes. The gateway
runs with its defaults (cache_aware is not told the servers' cache size unless `--told`). The hit ratio
is the prefill servers' own: cached over prompt tokens (their `/metrics`), per worker count
on the same plan and the same servers (flushed in between). Prints one table.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import orjson

from loadtests.launch import HOST, free_port, running
from loadtests.routing.cluster import SimOptions, difference, settle, sim_cluster, snapshot
from loadtests.routing.drive import drive_chat, via_proxy
from loadtests.routing.workloads import ChatPlan, ChatShape, Conversation, words, zipf_weights


def chats_plan(chats: int, turns: int, seed: int, think: float) -> ChatPlan:
    """`chats` conversations of exactly `turns` turns, started over the first 4 s, each on
    one of the shape's system prompts (Zipf)."""
    shape = ChatShape(turns=(turns, turns), think_s=think)
    rng = random.Random(f"workers_hit/{seed}")
    systems = [f"{shape.title} {i}. " + words(rng, shape.system_tokens)
               for i in range(shape.system_prompts)]
    weights = zipf_weights(shape.system_prompts, shape.popularity)
    conversations, system_of = [], []
    for _ in range(chats):
        index = rng.choices(range(shape.system_prompts), weights)[0]
        users = tuple(words(rng, rng.randint(*shape.user_tokens)) for _ in range(turns))
        thinks = tuple(rng.expovariate(1.0 / think) for _ in range(turns))
        conversations.append(Conversation(rng.uniform(0.0, 4.0), systems[index], users, thinks))
        system_of.append(index)
    return ChatPlan(shape, tuple(conversations), tuple(system_of))


def measure(cluster, workers: int, plan: ChatPlan, log_dir: Path, told: bool,
            extra: list[str]) -> tuple[float, int, dict]:
    """(hit ratio, failed requests, requests per prefill) of one gateway run with its
    defaults (as a new user starts it), `told` the servers' cache size or not."""
    settle(cluster)
    port = free_port()
    argv = [sys.executable, "-m", "gateway", "--host", HOST, "--port", str(port),
            "--log-level", "warning", "--workers", str(workers)]
    for server in cluster.prefills:
        argv += ["--prefill", server.url, str(server.bootstrap_port)]
    for server in cluster.decodes:
        argv += ["--decode", server.url]
    argv += extra
    if told:  # the prompt cache of a server (else the gateway reads its KV pool's size)
        argv += ["--policy-options", orjson.dumps(
            {"cache_aware": {"cache_tokens": cluster.options.cache_tokens}}).decode()]
    with running(f"gateway-w{workers}", argv, log_dir,
                 f"http://127.0.0.1:{port}/readiness"):
        time.sleep(1.0)  # every worker's first /v1/loads poll
        before = snapshot(cluster)
        drive = asyncio.run(drive_chat(via_proxy(port, 60.0), plan, 1e9))
        after = snapshot(cluster)
    figures = difference(before, after)
    failed = sum(not s.reply.ok for s in drive.samples)
    return figures.hit_rate, failed, figures.requests


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.workers_hit", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="1,2", help="worker counts to compare")
    parser.add_argument("--seeds", default="0", help="plans, e.g. 0,1,2")
    parser.add_argument("--chats", type=int, default=24)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--prefills", type=int, default=2)
    parser.add_argument("--cache-tokens", type=int, default=8192, help="per prefill server")
    parser.add_argument("--told", action="store_true",
                        help="give cache_aware the servers' cache size (option cache_tokens)")
    parser.add_argument("--gateway-args", default="", help="more gateway flags, one string")
    parser.add_argument("--think", type=float, default=1.0, help="mean seconds between turns")
    args = parser.parse_args(argv)
    counts = [int(w) for w in args.workers.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    options = SimOptions(prefills=args.prefills, decodes=1, cache_tokens=args.cache_tokens)
    hits: dict[int, list[float]] = {n: [] for n in counts}
    with tempfile.TemporaryDirectory(prefix="workers_hit-") as tmp, \
            sim_cluster(options, Path(tmp)) as cluster:
        print("| seed | workers | hit ratio | failed | requests per prefill |")
        print("|---|---|---|---|---|")
        for seed in seeds:
            plan = chats_plan(args.chats, args.turns, seed, args.think)
            for n in counts:
                hit, failed, per_server = measure(cluster, n, plan, Path(tmp), args.told,
                                                  args.gateway_args.split())
                hits[n].append(hit)
                print(f"| {seed} | {n} | {hit:.3f} | {failed} | "
                      f"{', '.join(str(v) for v in per_server.values())} |", flush=True)
    base = statistics.mean(hits[counts[0]])
    for n in counts[1:]:
        mean = statistics.mean(hits[n])
        print(f"{n} workers: mean hit {mean:.3f} vs {base:.3f} with {counts[0]}: "
              f"{100 * (base - mean):+.1f} points below")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
