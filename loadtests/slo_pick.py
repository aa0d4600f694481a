"""What a pick costs: CPU per (prefill, decode) choice of the `slo` policy's joint choice
against the independent `cache_aware` + `least_load` picks, by fleet size.

    python -m loadtests.slo_pick [--picks 2000] [--top-k 4]

No sockets: servers with fresh `/v1/loads` figures and in-flight counts, a prefix tree
warmed with conversations of a few shared system prompts, then `Scheduler.pick` timed with
`time.process_time` over many requests (each one dispatched and completed, so the trees and
counters move as in service). Prints a table; not a timed test.
"""

from __future__ import annotations

import argparse
import random
import time

import orjson

from gateway.policies import create_policy
from gateway.request import GENERATE, parse_request
from gateway.scheduling.models import Models
from gateway.scheduling.scheduler import Scheduler
from gateway.servers.load import ServerLoad
from gateway.servers.pool import Server, ServerPool

FLEETS = ((2, 2), (8, 8), (32, 32), (128, 128), (512, 512))
SYSTEMS = 8  # shared system prompts
PROMPT = 2000  # tokens per request


def fleet(prefills: int, decodes: int, rng: random.Random) -> ServerPool:
    pool = ServerPool()
    now = time.monotonic()
    for role, count in (("prefill", prefills), ("decode", decodes)):
        for i in range(count):
            server = Server(url=f"http://{role}-{i}:30000", role=role)
            server.verified = True
            server.load = ServerLoad(
                running=rng.randint(0, 64), waiting=rng.randint(0, 8),
                waiting_uncached_tokens=rng.randint(0, 20_000), used_tokens=rng.randint(0, 10**5),
                max_total_tokens=400_000, max_running_requests=256, updated_at=now,
                prefill_speed=20_000.0)
            pool.add(server)
    return pool


def requests(count: int, rng: random.Random) -> list:
    views = []
    for i in range(count):
        system = [s * 7 for s in range(rng.randrange(SYSTEMS) * 1000, 1000 + 900)]
        ids = system[:PROMPT // 2] + [rng.randrange(1 << 20) for _ in range(PROMPT // 2)]
        views.append(parse_request(GENERATE, orjson.dumps(
            {"input_ids": ids, "sampling_params": {"max_new_tokens": 64}, "rid": f"r{i}"})))
    return views


def scheduler(pool: ServerPool, prefill: str, decode: str, top_k: int) -> Scheduler:
    def build(_model):
        options = {"top_k": top_k} if prefill == "slo" else None
        return {"prefill": create_policy(prefill, "prefill", options),
                "decode": create_policy(decode, "decode")}

    return Scheduler(pool, Models(pool, build))


def cost(pool: ServerPool, views: list, prefill: str, decode: str, top_k: int) -> float:
    """Microseconds of CPU per pick (dispatch and completion hooks included)."""
    sched = scheduler(pool, prefill, decode, top_k)
    policies = sched.policies
    for view in views[:200]:  # warm the trees
        target, dec = sched.pick(view)
        policies["prefill"].on_dispatch(target, view)
    started = time.process_time()
    for view in views:
        target, dec = sched.pick(view)
        policies["prefill"].on_dispatch(target, view)
        policies["decode"].on_dispatch(dec, view)
        policies["prefill"].on_complete(target, view, True)
        policies["decode"].on_complete(dec, view, True)
    return (time.process_time() - started) / len(views) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--picks", type=int, default=2000)
    parser.add_argument("--top-k", type=int, default=4)
    args = parser.parse_args()
    rng = random.Random(7)
    views = requests(args.picks, rng)
    print(f"CPU per pick (us), {args.picks} picks of {PROMPT}-token prompts, top_k "
          f"{args.top_k}")
    print(f"{'prefills x decodes':>20} {'cache_aware+least_load':>24} {'slo (joint)':>12} "
          f"{'ratio':>6}")
    for prefills, decodes in FLEETS:
        pool = fleet(prefills, decodes, rng)
        base = cost(pool, views, "cache_aware", "least_load", args.top_k)
        joint = cost(pool, views, "slo", "slo", args.top_k)
        print(f"{f'{prefills} x {decodes}':>20} {base:>24.1f} {joint:>12.1f} "
              f"{joint / base:>6.2f}")


if __name__ == "__main__":
    main()
