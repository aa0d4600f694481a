"""What the shared prefix table (gateway/prefix/shared.py) costs a worker per prompt, by size.

    python -m loadtests.shared_prefix_cost
    python -m loadtests.shared_prefix_cost --sizes 200,2000,16000 --prompts 1000 --rounds 20

With `--workers N`, cache_aware looks each prompt up in the table when it picks and records
it when it dispatches. `logic_cost --configs worker` measures the whole request of a worker,
but with its one short prompt (under one 256-byte block) the table has nothing to do there;
this times the lookup and the record over prompts of each size, in the order a worker runs
them (each prompt recorded on its first round, found on the next), against an in-memory
table of the shared block's size. Not a test: nothing asserts a duration; run it in two
trees to compare.
"""

from __future__ import annotations

import argparse
import time

from gateway.prefix.shared import WORDS, SharedPrefixes

TARGETS = [f"http://10.0.0.{i}:30000" for i in range(1, 6)]


def new_table() -> SharedPrefixes:
    return SharedPrefixes(memoryview(bytearray(8 * WORDS)).cast("q"))


def prompts(size: int, count: int) -> list[str]:
    """`count` different prompts of `size` characters (they differ from the start)."""
    filler = "lorem ipsum dolor sit amet " * (size // 27 + 1)
    return [f"{i:06d} {filler}"[:size] for i in range(count)]


def per_prompt(size: int, count: int, rounds: int) -> float:
    """Microseconds of one `find` and one `record` for prompts of `size` characters."""
    table, keys, clock = new_table(), prompts(size, count), time.monotonic
    for key in keys:  # every prompt recorded once: the timed rounds find them
        table.record(key, TARGETS[0], clock())
    start = time.perf_counter()
    for _ in range(rounds):
        for key in keys:
            table.find(key, TARGETS, clock())
            table.record(key, TARGETS[0], clock())
    return (time.perf_counter() - start) / (rounds * count) * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.shared_prefix_cost",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="200,2000,16000", help="prompt lengths in characters")
    p.add_argument("--prompts", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args(argv)
    print("| prompt (characters) | find + record, us |")
    print("|---|---|")
    for size in (int(s) for s in args.sizes.split(",") if s.strip()):
        print(f"| {size:,} | {per_prompt(size, args.prompts, args.rounds):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
