"""Offline replay of the DP chat workload through a prefill policy: seconds instead of minutes.

    python -m loadtests.routing.replay                       # seeds 0-7, 16,384 tokens a server
    python -m loadtests.routing.replay --seeds 0,2,4 --cache-tokens 32768 --policy prefix_cache
    python -m loadtests.routing.replay --workers 4 --ranks 1 --servers 4   # 1 vs 4 processes

The same plan as `--workload dp` (`workloads.chat_plan`, 6 turns/s for 20 s), replayed
in virtual time: each turn is picked and dispatched by the policy, its prompt (the simulator's
chat template and tokenizer) is matched against and inserted into that target's
`backends.sim.radix.RadixCache` (LRU, a quarter of the server's cache per rank), it lasts its
prefill (5 ms + 0.05 ms per uncached token) plus 48 decode steps of 7.5 ms, and the next turn
follows after the plan's think time. No HTTP, no load figures from `/v1/loads` (the gateway's
own in-flight counters only), no queueing: a model for comparing policies and tuning them, not
a substitute for the benchmark, whose figures it follows within a few points.

Per seed: the hit rate with 1 rank and with `--ranks` ranks per server, their ratio (the
issue's "vs 1 rank"), and the requests each rank served. With `--workers N`: the hit rate of
one policy instance against N (each turn to a random one, as the kernel spreads connections
over `--workers` processes), sharing the prefix table of gateway/prefix/shared.py
unless `--unshared`, and the gap in points.
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
from collections.abc import Callable
from unittest import mock

import orjson

from backends.sim.radix import RadixCache
from backends.sim.tokenizer import encode, render_chat
from gateway.policies import REGISTRY, create_policy
from gateway.prefix.shared import WORDS, SharedPrefixes
from gateway.request import CHAT, parse_request
from gateway.servers.pool import Server
from gateway.servers.probe import ServerFacts
from loadtests.routing.workloads import ChatShape, chat_plan, words

START = 1000.0  # virtual monotonic time of the run's start
PREFILL_S = (0.005, 0.00005)  # overhead, per uncached token (the sim's H100 model)
DECODE_S = 48 * 0.0075  # 48 output tokens


class Replay:
    """One layout (servers x ranks, cache per server) and one policy, in virtual time."""

    def __init__(self, policy: str, servers: int, ranks: int, cache_tokens: int,
                 told: bool = True, workers: int = 1, shared: bool = True) -> None:
        per_target = cache_tokens // ranks
        told = told and "cache_tokens" in REGISTRY[policy].Options.__dataclass_fields__
        options = {"cache_tokens": per_target} if told else {}
        # --workers N: N processes' policies, each turn to one of them at random (as the
        # kernel spreads connections), sharing a prefix table unless `shared` is False
        self.policies = [create_policy(policy, "prefill", options) for _ in range(workers)]
        if workers > 1 and shared:
            table = SharedPrefixes(memoryview(bytearray(8 * WORDS)).cast("q"))
            for each in self.policies:
                each.share(table)
        self.policy = self.policies[0]
        self._spread = random.Random(workers)
        self.servers = [Server(url=f"http://10.0.0.{i + 1}:30000", role="prefill")
                        for i in range(servers)]
        for server in self.servers:
            server.apply_facts(ServerFacts("prefill", 8998, "sim-model", ranks))
        self.targets = [r for s in self.servers for r in s.ranks] if ranks > 1 else self.servers
        self.caches = {t.url: RadixCache(1, per_target) for t in self.targets}
        self.served = {t.url: 0 for t in self.targets}
        for each in self.policies:
            each.on_servers_changed(self.targets)
        self.now = START
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self.prompt = self.cached = 0

    def at(self, when: float, action: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._events, (when, self._seq, action))

    def turn(self, conv, index: int, messages: list[dict], duration: float,
             rng: random.Random) -> None:
        if index >= len(conv.users) or self.now - START >= duration:
            return
        messages = [*messages, {"role": "user", "content": conv.users[index]}]
        view = parse_request(CHAT, orjson.dumps({"messages": messages, "max_tokens": 48}))
        policy = self.policies[self._spread.randrange(len(self.policies))]
        target = policy.pick(self.targets, view)
        # as the proxy counts a prefill: the part the policy expects uncached there
        predicted = policy.predicted_hit(target, view) or 0.0
        counted = view.prompt_tokens - round(predicted * view.prompt_tokens)
        policy.on_dispatch(target, view)
        target.start(counted)
        tokens = encode(render_chat(messages))
        cache = self.caches[target.url]
        cached = cache.match(tokens)
        self.prompt += len(tokens)
        self.cached += cached
        self.served[target.url] += 1
        prefill = PREFILL_S[0] + PREFILL_S[1] * (len(tokens) - cached)
        self.at(self.now + prefill, lambda: cache.insert(tokens))
        reply = {"role": "assistant", "content": words(rng, 48)}

        def done() -> None:
            if target.rank is None:
                target.finish(counted, True)
            else:
                target.finish(counted)
            policy.on_complete(target, view, True)
            self.at(self.now + conv.thinks[index],
                    lambda: self.turn(conv, index + 1, [*messages, reply], duration, rng))

        self.at(self.now + prefill + DECODE_S, done)

    def run(self, seed: int, rate: float, duration: float) -> float:
        """Replays the plan; the hit rate (cached over prompt tokens)."""
        plan = chat_plan(ChatShape(), rate, duration, seed)
        rng = random.Random(seed)
        for conv in plan.conversations:
            first = [{"role": "system", "content": conv.system}]
            self.at(START + conv.start,
                    lambda c=conv, m=first: self.turn(c, 0, m, duration, rng))
        with mock.patch("time.monotonic", lambda: self.now):
            while self._events:
                self.now, _, action = heapq.heappop(self._events)
                action()
        return self.cached / self.prompt if self.prompt else 0.0


def compare(policy: str, seed: int, servers: int, ranks: int, cache_tokens: int,
            told: bool = True, rate: float = 6.0, duration: float = 20.0) -> dict:
    """One seed: hit rates with one rank and with `ranks`, their ratio, requests per rank;
    `told`: the policy is given the cache size (else it knows none: no capacity decisions)."""
    one = Replay(policy, servers, 1, cache_tokens, told)
    many = Replay(policy, servers, ranks, cache_tokens, told)
    base, hit = one.run(seed, rate, duration), many.run(seed, rate, duration)
    return {"seed": seed, "hit_1_rank": base, "hit": hit, "ratio": hit / base if base else 0.0,
            "per_rank": list(many.served.values())}


def compare_workers(policy: str, seed: int, servers: int, ranks: int, cache_tokens: int,
                    workers: int, shared: bool = True, rate: float = 6.0,
                    duration: float = 20.0) -> dict:
    """One seed: hit rates with one worker process and with `workers` (their policies
    sharing the prefix table unless `shared` is False)."""
    one = Replay(policy, servers, ranks, cache_tokens)
    many = Replay(policy, servers, ranks, cache_tokens, workers=workers, shared=shared)
    base, hit = one.run(seed, rate, duration), many.run(seed, rate, duration)
    return {"seed": seed, "hit_1": base, "hit": hit, "gap_points": 100 * (base - hit)}


def _seeds(text: str) -> list[int]:
    if "-" in text:
        low, high = text.split("-")
        return list(range(int(low), int(high) + 1))
    return [int(s) for s in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.routing.replay",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default="cache_aware", choices=sorted(REGISTRY))
    parser.add_argument("--seeds", default="0-7", help="e.g. 0-7 or 0,2,4")
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--cache-tokens", type=int, default=16384, help="per server")
    parser.add_argument("--blind", action="store_true",
                        help="do not tell the policy the cache size (no capacity decisions)")
    parser.add_argument("--workers", type=int, default=1,
                        help="compare 1 worker process with this many (at --ranks)")
    parser.add_argument("--unshared", action="store_true",
                        help="with --workers: the processes share no prefix table")
    args = parser.parse_args(argv)
    if args.workers > 1:
        rows = [compare_workers(args.policy, s, args.servers, args.ranks, args.cache_tokens,
                                args.workers, not args.unshared) for s in _seeds(args.seeds)]
        for row in rows:
            print(f"seed {row['seed']}: hit {100 * row['hit_1']:.1f}% with 1 worker, "
                  f"{100 * row['hit']:.1f}% with {args.workers}: "
                  f"gap {row['gap_points']:.1f} points")
        gaps = [r["gap_points"] for r in rows]
        print(f"gap mean {statistics.mean(gaps):.2f} points, max {max(gaps):.2f}")
        return 0
    rows = [compare(args.policy, s, args.servers, args.ranks, args.cache_tokens, not args.blind)
            for s in _seeds(args.seeds)]
    for row in rows:
        print(f"seed {row['seed']}: hit {100 * row['hit_1_rank']:.1f}% with 1 rank, "
              f"{100 * row['hit']:.1f}% with {args.ranks}: {row['ratio']:.3f}x, "
              f"per rank {row['per_rank']}")
    ratios = [r["ratio"] for r in rows]
    print(f"ratio mean {statistics.mean(ratios):.3f}, min {min(ratios):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
