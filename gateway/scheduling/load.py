"""The load model the load-aware policies share (a helper, not a policy).

A server's load comes from two sources that fail differently. The gateway's own counters
(`in_flight`, `in_flight_tokens`, summed over the gateway's worker processes with `--workers`:
`Server.totals`) are exact and immediate but blind to traffic that reaches the server by other
routes (other gateway replicas, direct clients). The server's `/v1/loads` figures
see everything but lag by up to one poll. So when the server's figures are fresh we take the
larger of the two for each quantity (taking the sum would count this gateway's requests twice);
when they are not, we use the gateway's counters alone. A snapshot taken while some of our
requests ran still counts them after they finished: those are taken off it (`ServerLoad.settle`:
requests, and their prompts' share of `token_usage`). A prefill leg whose decode already has
the KV, its answer still to come, counts as no load (`Server.working`): it has computed.

Degrade consistently: comparing one server on reported figures with another on gateway counters
is comparing different things, so if any candidate lacks fresh figures, ALL candidates are scored
on the gateway counters (the lesson of sglang-router's `power_of_two.rs`).

Load units: one unit is one request; `token_unit` prompt tokens add one more; a server whose KV
pool is full adds `usage_weight`. The tokens are those still to be computed: the gateway counts
a prefill's in-flight request by the part its policy expected uncached there
(gateway/dispatch/proxy.py; the whole prompt without a guess), the server reports
`waiting_uncached_tokens`; a cached prefix costs the server little, and counting it would
make a server holding a hot document look overloaded and send its requests away from the
cache (docs/BENCHMARKS.md).

A request's *cost* on a target adds its own uncached part there to the target's load
(`with_uncached`): what it would queue. Leaving the cache for a lower cost elsewhere pays only
when that cost is clearly lower (`move_factor` times, plus one unit: `cheapest`, `spread`):
the move computes the prefix a second time and takes room in a second cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.servers.pool import Server


@dataclass(frozen=True)
class LoadOptions:
    """Options of the load score, shared by every load-aware policy."""

    token_unit: int = 512  # prompt tokens that weigh as much as one request
    usage_weight: float = 32.0  # load units added by a full KV pool (token_usage 1.0)
    load_max_age: float = 6.0  # seconds a /v1/loads snapshot counts as fresh (3 polls at 2 s)
    move_factor: float = 1.2  # leave the cache only for a cost this many times lower (+1 unit)

    def validate(self) -> None:
        if self.token_unit < 1:
            raise ValueError(f"option 'token_unit' must be >= 1, got {self.token_unit}")
        if self.usage_weight < 0:
            raise ValueError(f"option 'usage_weight' must be >= 0, got {self.usage_weight}")
        if self.load_max_age <= 0:
            raise ValueError(f"option 'load_max_age' must be > 0, got {self.load_max_age}")
        if self.move_factor < 1.0:
            raise ValueError(f"option 'move_factor' must be >= 1, got {self.move_factor}")


def all_fresh(servers: Sequence[Server], now: float, max_age: float) -> bool:
    """Whether every server's `/v1/loads` snapshot is recent (stamped with time.monotonic();
    0: never taken). A loop, not a generator: it runs on every pick."""
    for server in servers:
        updated = server.load.updated_at
        if updated <= 0.0 or now - updated > max_age:
            return False
    return True


def counted_scores(servers: Sequence[Server], token_unit: int, now: float) -> list[float]:
    """Each server's load on the gateway's own counters alone (every worker's, with
    `--workers`): requests plus prompt tokens in `token_unit`s."""
    scores = []
    for server in servers:
        requests, tokens = server.working(now)
        scores.append(requests + tokens / token_unit)
    return scores


def load_scores(servers: Sequence[Server], options: LoadOptions, now: float) -> list[float]:
    """Each server's load in load units, all on one consistent basis: the servers' reported
    figures count only when every compared snapshot is fresh, else the gateway's counters
    alone. One loop per basis, no call per server: every request's decode pick and prefill
    pick come here (comparisons, not max(), for the same reason)."""
    unit = options.token_unit
    if not all_fresh(servers, now, options.load_max_age):
        return counted_scores(servers, unit, now)
    scores = []
    weight = options.usage_weight
    for server in servers:
        requests, tokens = server.working(now)
        reported = server.load  # the larger of ours and the snapshot's
        running = reported.running + reported.waiting - reported.settled
        if running > requests:
            requests = running
        if reported.waiting_uncached_tokens > tokens:
            tokens = reported.waiting_uncached_tokens
        usage = reported.token_usage
        if reported.settled_tokens and reported.max_total_tokens:  # ours that ended since
            usage -= reported.settled_tokens / reported.max_total_tokens
            if usage < 0.0:
                usage = 0.0
        scores.append(requests + tokens / unit + weight * usage)
    return scores


def rotating_argmin(values: Sequence[float], start: int) -> int:
    """Index of the minimum; ties go to the first one at or after `start` (cyclically).

    Rotating the start spreads ties evenly instead of piling them on the first server.
    """
    n = len(values)
    low = min(values)
    if n < 2 or values.count(low) == 1:  # one minimum: no tie to rotate (in C)
        return values.index(low)
    best = start % n
    best_value = values[best]
    for step in range(1, n):
        i = (start + step) % n
        if values[i] < best_value:
            best, best_value = i, values[i]
    return best


def imbalanced(scores: Sequence[float], abs_threshold: float, rel_threshold: float) -> bool:
    """sglang-router's guard: max - min > abs AND max > min * rel (cache_aware's balance
    guard, and session affinity's test of a remembered server against the least loaded)."""
    if len(scores) < 2:
        return False
    high, low = max(scores), min(scores)
    return high - low > abs_threshold and high > low * rel_threshold


def with_uncached(scores: Sequence[float], lengths: Sequence[int], key_len: int,
                  tokens: float, token_unit: int) -> list[float]:
    """Each target's load plus the request's own uncached part there (`lengths` of its
    `key_len` matched; `tokens` the prompt's): the cost of sending it there."""
    if not key_len:
        return [s + tokens / token_unit for s in scores]
    per_item = tokens / key_len / token_unit
    return [s + (key_len - n) * per_item for s, n in zip(scores, lengths, strict=True)]


def _clearly_lower(there: float, here: float, factor: float) -> bool:
    return here > there * factor + 1.0


def cheapest(costs: Sequence[float], lengths: Sequence[int], factor: float,
             start: int) -> int:
    """The imbalance guard's choice: of the targets whose cost is not clearly above the
    lowest, the longest match (the cache keeps what the move would not save), then the
    lowest cost (ties rotate from `start`)."""
    low = min(costs)
    near = [not _clearly_lower(low, c, factor) for c in costs]
    longest = max(n for n, ok in zip(lengths, near, strict=True) if ok)
    return rotating_argmin([c if ok and n == longest else float("inf")
                            for c, n, ok in zip(costs, lengths, near, strict=True)], start)


def spread(order: Sequence[int], costs: Sequence[float], fresh: Sequence[bool], chosen: int,
           factor: float) -> int | None:
    """A `fresh` target (one not holding the prompt's prefix) whose cost is clearly below
    that of the `chosen` holder, the lowest first, then the first in `order` (candidate
    indices in ring order of the prompt's anchor, `Ring.order`, so processes agree); None:
    stay. Its cost includes computing the prefix, so a new copy of a hot prefix is made only
    once the holders' queues outweigh that; a holder the capacity test left out is no fresh
    target."""
    best = None
    for i in order:
        if fresh[i] and (best is None or costs[i] < costs[best]):
            best = i
    if best is None or not _clearly_lower(costs[best], costs[chosen], factor):
        return None
    return best
