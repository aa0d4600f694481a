"""Data parallelism inside one server: DP ranks and the controller that picks one.

Each rank is a scheduler of its own, as in SGLang: its own queue and running
batch (an `Engine`), its own radix cache, its own KV-event publisher (port
base + rank), and on a prefill its own KV manager, i.e. its own bootstrap
rooms: a prefill rank only pairs with a decode that asks that rank for the
room. With `--dp-size 1` there is one rank and no controller (`pick` is never
called), as SGLang runs no DataParallelController then.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

from backends.sim.config import SimConfig
from backends.sim.engine import Engine
from backends.sim.job import ItemSpec
from backends.sim.kv_events import KvEventPublisher
from backends.sim.radix import RadixCache
from backends.sim.rooms import RoomRegistry

CONTROLLER_CRASH_EXIT_CODE = 18
_BUDGET_REFRESH_S = 0.02  # DataParallelController.refresh_load_budget's throttle


@dataclass(eq=False)
class DpRank:
    """One DP rank (one scheduler) of a server."""

    index: int
    engine: Engine
    cache: RadixCache
    publisher: KvEventPublisher | None = None
    registry: RoomRegistry | None = None  # prefill: this rank's KV manager's rooms
    decode_rooms: set[int] = field(default_factory=set)  # decode: rooms this rank receives


def build_ranks(config: SimConfig, open_ttl: float) -> list[DpRank]:
    """One rank per scheduler; each KV-event publisher binds base port + rank.

    The publisher's rank mirrors select_kv_publisher_dp_rank (disaggregation/kv_events.py):
    attn_dp_rank under attention DP, dp_rank otherwise; both run 0..num_dp_ranks-1.
    """
    events_on = config.kv_events is not None and config.kv_events.enabled
    ranks = []
    for index in range(config.num_dp_ranks):
        cache = RadixCache(config.page_size, config.cache_capacity_tokens, record_events=events_on)
        rank = DpRank(index, Engine(config, cache), cache)
        if events_on and config.kv_events is not None:
            rank.publisher = KvEventPublisher(config.kv_events, config.page_size,
                                              config.kv_events_encoding, dp_rank=index)
            cache.on_events = rank.publisher.publish
        if config.mode == "prefill":
            rank.registry = RoomRegistry(open_ttl=open_ttl, dp_rank=index)
        ranks.append(rank)
    return ranks


class DpController:
    """Picks the rank of each request; mirrors DataParallelController (managers/data_parallel_controller.py)."""

    def __init__(self, config: SimConfig, ranks: list[DpRank]) -> None:
        self.ranks = ranks
        self.method = config.load_balance_method
        self._next = 0
        self._refreshed = 0.0
        self.budget_requests = [0] * len(ranks)
        self.budget_tokens = [0] * len(ranks)
        self.dispatched = [0] * len(ranks)

    def pick(self, spec: ItemSpec) -> int:
        """The rank that serves `spec`.

        mirrors maybe_external_dp_rank_routing (routed_dp_rank first; its range was checked by
        the tokenizer manager), then follow_bootstrap_room_scheduler (room % ranks),
        round_robin_scheduler, total_requests_scheduler or total_tokens_scheduler.
        """
        count = len(self.ranks)
        if spec.routed_dp_rank is not None:
            rank = spec.routed_dp_rank
        elif self.method == "follow_bootstrap_room":
            if spec.bootstrap_room is None:
                _controller_crash()
            rank = spec.bootstrap_room % count
        elif self.method == "round_robin":
            rank = self._next
            self._next = (rank + 1) % count
        else:
            rank = self._budget_pick(len(spec.input_ids))
        self.dispatched[rank] += 1
        return rank

    def _budget_pick(self, tokens: int) -> int:
        """mirrors DPBudget.dispatch: the least loaded rank, then a speculative +1.

        The budget is refreshed from the ranks' live load at most every 20 ms
        (refresh_load_budget), so a burst spreads over the ranks in between.
        """
        now = time.perf_counter()
        if now - self._refreshed >= _BUDGET_REFRESH_S:
            self._refreshed = now
            for r in self.ranks:
                self.budget_requests[r.index] = r.engine.num_running + len(r.engine.waiting)
                self.budget_tokens[r.index] = r.engine.num_total_tokens
        reqs, toks = self.budget_requests, self.budget_tokens
        if self.method == "total_requests":
            rank = reqs.index(min(reqs))
        else:  # total_tokens, total_requests breaking ties
            rank = min(range(len(reqs)), key=lambda i: (toks[i], reqs[i]))
            toks[rank] += tokens
        reqs[rank] += 1
        return rank


def _controller_crash() -> None:
    """A roomless request under follow_bootstrap_room kills the server.

    mirrors follow_bootstrap_room_scheduler's assert (managers/data_parallel_controller.py):
    the AssertionError ends the controller's event loop, and
    run_data_parallel_controller_process answers it with SIGQUIT to the server.
    """
    sys.stderr.write("sim: DataParallelController hit an exception: AssertionError: "
                     "req.bootstrap_room should not be None. Do not send requests directly to "
                     "prefill or decode instances; send to the router instead.\n")
    sys.stderr.flush()
    os._exit(CONTROLLER_CRASH_EXIT_CODE)
