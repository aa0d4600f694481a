"""The load model the load-aware policies share (a helper, not a policy).

A worker's load comes from two sources that fail differently. The gateway's own counters
(`in_flight`, `in_flight_tokens`, summed over the gateway's worker processes with `--workers`:
`Worker.totals`) are exact and immediate but blind to traffic that reaches the server by other
routes (other gateway replicas, direct clients). The server's `/v1/loads` figures
see everything but lag by up to one poll. So when the server's figures are fresh we take the
larger of the two for each quantity (taking the sum would count this gateway's requests twice);
when they are not, we use the gateway's counters alone.

Degrade consistently: comparing one worker on server figures with another on gateway counters
is comparing different things, so if any candidate lacks fresh figures, ALL candidates are scored
on the gateway counters (the lesson of sglang-router's `power_of_two.rs`).

Load units: one unit is one request; `token_unit` prompt tokens add one more; a server whose KV
pool is full adds `usage_weight`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.workers import Worker


@dataclass(frozen=True)
class LoadOptions:
    """Options of the load score, shared by every load-aware policy."""

    token_unit: int = 512  # prompt tokens that weigh as much as one request
    usage_weight: float = 32.0  # load units added by a full KV pool (token_usage 1.0)
    load_max_age: float = 6.0  # seconds a /v1/loads snapshot counts as fresh (3 polls at 2 s)

    def validate(self) -> None:
        if self.token_unit < 1:
            raise ValueError(f"option 'token_unit' must be >= 1, got {self.token_unit}")
        if self.usage_weight < 0:
            raise ValueError(f"option 'usage_weight' must be >= 0, got {self.usage_weight}")
        if self.load_max_age <= 0:
            raise ValueError(f"option 'load_max_age' must be > 0, got {self.load_max_age}")


def is_fresh(worker: Worker, now: float, max_age: float) -> bool:
    """Whether the worker's `/v1/loads` snapshot is recent (stamped with time.monotonic())."""
    updated = worker.load.updated_at
    return updated > 0.0 and now - updated <= max_age


def all_fresh(workers: Sequence[Worker], now: float, max_age: float) -> bool:
    return all(is_fresh(w, now, max_age) for w in workers)


def load_score(worker: Worker, options: LoadOptions, use_server: bool) -> float:
    """The worker's load in load units; `use_server` only when every compared worker is fresh."""
    requests, tokens = worker.totals()
    usage = 0.0
    if use_server:
        server = worker.load
        requests = max(requests, server.running + server.waiting)
        tokens = max(tokens, server.waiting_uncached_tokens)
        usage = server.token_usage
    return requests + tokens / options.token_unit + options.usage_weight * usage


def load_scores(workers: Sequence[Worker], options: LoadOptions, now: float) -> list[float]:
    """Scores of all `workers` on one consistent basis."""
    use_server = all_fresh(workers, now, options.load_max_age)
    return [load_score(w, options, use_server) for w in workers]


def rotating_argmin(values: Sequence[float], start: int) -> int:
    """Index of the minimum; ties go to the first one at or after `start` (cyclically).

    Rotating the start spreads ties evenly instead of piling them on the first worker.
    """
    n = len(values)
    best = start % n
    best_value = values[best]
    for step in range(1, n):
        i = (start + step) % n
        if values[i] < best_value:
            best, best_value = i, values[i]
    return best


def imbalanced(scores: Sequence[float], abs_threshold: float, rel_threshold: float) -> bool:
    """sglang-router's guard: max - min > abs AND max > min * rel."""
    if len(scores) < 2:
        return False
    high, low = max(scores), min(scores)
    return high - low > abs_threshold and high > low * rel_threshold
