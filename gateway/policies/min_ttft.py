"""min_ttft: pick by estimated cost instead of thresholds.

Prefill: the estimated time to first token on a server is the prefill work queued ahead of the
request plus the request's own uncached part, over the server's prefill speed:

    ttft(w) = (queued(w) + prompt_tokens * (1 - matched(w) / key_length)) / speed(w)

speed(w) is measured from the server's own reports: `/v1/loads` carries the tokens its
prefill steps extended and their busy time (cumulative, SGLang's
`Scheduler._record_step_counters`), smoothed over polls (`ServerLoad.prefill_speed`; per DP
rank for a rank); until a server has prefilled between two polls, `prefill_tokens_per_second`.

queued(w) is the larger of the server's `waiting_uncached_tokens` (when every candidate's
`/v1/loads` is fresh) and the uncached tokens this policy has sent to w that have not completed
(the sum would count this gateway's queued requests twice); matched(w) comes from an approximate
prefix tree of past dispatches, as in `cache_aware`. Unlike a threshold, this trades a longer
cached prefix against a shorter queue token for token.

Decode: the work is already sized, so pick the server with the most headroom: the lowest
utilization, the larger of KV token usage and running requests over `max_running_requests`
(each corrected by this gateway's in-flight counts). Without fresh figures for every candidate,
the gateway's in-flight requests and tokens decide.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.policies.base import Policy
from gateway.prefix.tree import PrefixTree
from gateway.request import RequestView
from gateway.scheduling.load import all_fresh, rotating_argmin
from gateway.servers.pool import Server


@dataclass(frozen=True)
class MinTtftOptions:
    """Throughput model and the prefix tree bound."""

    # one prefill server (8B model on an H100), until the server's own speed is measured
    prefill_tokens_per_second: float = 20000.0
    token_unit: int = 512  # decode without fresh figures: tokens that weigh like one request
    load_max_age: float = 6.0  # seconds a /v1/loads snapshot counts as fresh
    max_tree_size: int = 1 << 26  # characters over all servers (a token counts 4)
    eviction_ttl: float = 0.0  # seconds an unused prefix is kept; 0: only the size bound
    # A match shorter than this fraction of the prompt (role markers, a greeting) is noise,
    # not a cache hit worth following.
    min_match: float = 0.1
    # Estimates closer than this many seconds are ties, broken in turn: without it a few
    # characters of common prefix made one server always "cheaper" (docs/BENCHMARKS.md).
    tie_seconds: float = 0.005

    def validate(self) -> None:
        if not 0.0 <= self.min_match <= 1.0:
            raise ValueError(f"option 'min_match' must be in [0, 1], got {self.min_match}")
        if self.tie_seconds < 0:
            raise ValueError(f"option 'tie_seconds' must be >= 0, got {self.tie_seconds}")
        if self.prefill_tokens_per_second <= 0:
            raise ValueError("option 'prefill_tokens_per_second' must be > 0, "
                             f"got {self.prefill_tokens_per_second}")
        if self.token_unit < 1:
            raise ValueError(f"option 'token_unit' must be >= 1, got {self.token_unit}")
        if self.load_max_age <= 0:
            raise ValueError(f"option 'load_max_age' must be > 0, got {self.load_max_age}")
        if self.max_tree_size < 1:
            raise ValueError(f"option 'max_tree_size' must be >= 1, got {self.max_tree_size}")
        if self.eviction_ttl < 0:
            raise ValueError(f"option 'eviction_ttl' must be >= 0, got {self.eviction_ttl}")


class MinTtftPolicy(Policy):
    name = "min_ttft"
    Options = MinTtftOptions

    def __init__(self, role: str, options: MinTtftOptions | None = None) -> None:
        super().__init__(role, options)
        self.tree = PrefixTree(self.options.max_tree_size, self.options.eviction_ttl)
        self._turn = 0
        self._queued: dict[str, float] = {}  # uncached tokens sent, not yet completed
        self._sent: dict[tuple[int, str], float] = {}  # (id(view), url) -> its share
        self._last: tuple[RequestView | None, dict[str, int]] = (None, {})

    def pick(self, candidates: Sequence[Server], view: RequestView) -> Server:
        turn = self._turn
        self._turn += 1
        if len(candidates) == 1:
            return candidates[0]
        now = time.monotonic()
        fresh = all_fresh(candidates, now, self.options.load_max_age)
        if self.role == "decode":
            costs = [self._headroom_cost(w, fresh) for w in candidates]
        else:
            costs = self.ttft_estimates(candidates, view, fresh)
            tie = self.options.tie_seconds
            if tie > 0:
                costs = [round(cost / tie) for cost in costs]
        return candidates[rotating_argmin(costs, turn)]

    def ttft_estimates(self, candidates: Sequence[Server], view: RequestView,
                       fresh: bool) -> list[float]:
        """Estimated seconds to first token on each candidate."""
        default = self.options.prefill_tokens_per_second
        return [
            (self._queued_tokens(w, fresh) + self._uncached(w.url, view))
            / (w.load.prefill_speed or default)
            for w in candidates
        ]

    def _queued_tokens(self, server: Server, fresh: bool) -> float:
        queued = self._queued.get(server.url, 0.0)
        if fresh:
            queued = max(queued, server.load.waiting_uncached_tokens)
        return queued

    def predicted_hit(self, server: Server, view: RequestView) -> float | None:
        seen, matched = self._last
        key = view.routing_key
        if seen is not view or not key:
            return None
        return matched.get(server.url, 0) / len(key)

    def _uncached(self, url: str, view: RequestView) -> float:
        """Prompt tokens `url` would have to compute, given what it was sent before."""
        key = view.routing_key
        if not key:
            return float(view.prompt_tokens)
        seen, matched = self._last
        if seen is not view:
            matched = self.tree.match(key)
            self._last = (view, matched)
        share = matched.get(url, 0) / len(key)
        if share < self.options.min_match:
            share = 0.0
        return view.prompt_tokens * (1.0 - share)

    def _headroom_cost(self, server: Server, fresh: bool) -> float:
        if not fresh:
            requests, tokens = server.working()
            return requests + tokens / self.options.token_unit
        load = server.load
        utilization = load.token_usage
        if load.max_total_tokens > 0:
            utilization = max(utilization, server.working()[1] / load.max_total_tokens)
        # `max_running_requests` is a /v1/loads field the pool may not record yet.
        max_running = getattr(load, "max_running_requests", 0)
        if max_running > 0:
            running = max(load.running + load.waiting, server.working()[0])
            utilization = max(utilization, running / max_running)
        return utilization

    def on_dispatch(self, server: Server, view: RequestView) -> None:
        if self.role != "decode":
            share = self._uncached(server.url, view)
            self._sent[(id(view), server.url)] = share
            self._queued[server.url] = self._queued.get(server.url, 0.0) + share
        key = view.routing_key
        if key:
            self.tree.insert(key, server.url)

    def on_complete(self, server: Server, view: RequestView, success: bool) -> None:
        share = self._sent.pop((id(view), server.url), None)
        if share is not None:
            left = self._queued.get(server.url, 0.0) - share
            self._queued[server.url] = max(left, 0.0)

    def on_servers_changed(self, servers: Sequence[Server]) -> None:
        present = {w.url for w in servers}
        for url in set(self.tree.server_sizes()) - present:
            self.tree.remove_server(url)
        for url in set(self._queued) - present:
            del self._queued[url]
        for key in [k for k in self._sent if k[1] not in present]:
            del self._sent[key]

    def stats(self) -> dict:
        return {
            "tree_size": self.tree.size,
            "tree_nodes": self.tree.node_count,
            "queued_uncached_tokens": {url: round(v) for url, v in self._queued.items()},
        }
