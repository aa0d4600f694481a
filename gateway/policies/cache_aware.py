"""cache_aware: send a prompt where its longest prefix was sent before, unless load or the
targets' cache capacity says no.

Approximate: the gateway's own routing history stands in for the servers' prefix caches (for
the exact state see `prefix_cache`). What it does better than sglang-router's `cache_aware`:
- the key is the FULL routing key: every chat message rendered (`RequestView.routing_text`) or
  the whole `input_ids`, so two conversations sharing a system prompt are told apart by their
  history, not lumped together by their first message;
- one global memory bound for the tree, enforced on every insert (no periodic eviction thread
  that lets the tree overshoot), LRU leaves first; and, per target (server or DP rank), a
  budget of its cache size (option `cache_tokens`, else `max_total_num_tokens` from
  `/v1/loads`; a token counts 4 characters of text), its own LRU content first, so a match
  says what that target likely still holds (`prefix_tree.py`);
- the load signal counts the tokens still to compute (a prefill's in-flight request by the
  part predicted uncached there) and server-reported `/v1/loads` figures, not only request
  counts, and a request's cost on a target adds its own uncached part there (`load.py`): a
  server holding a hot document does not look busy for serving it; with `--workers`, the
  gateway's counters summed over the workers alone (`scores`);
- servers whose match is within a few percent of the best count as tied, so a few characters
  of coincidental overlap past a shared system prompt do not pin every request to one server;
  of the tied, the first in ring order of the prompt's anchor with bounded load wins
  (`placement.Ring.first`): every worker process and replica picks the same one without
  sharing state, a hot prefix's overflow goes to its next copy, and comes back as the load
  drops; a conversation's next turn stays with the targets that hold its previous turn, not
  merely the shared part;
- hot prefixes: when the holders' queues make another target clearly cheaper, the prefill of
  the prefix there included, a new copy is made there (`load.spread`, decision "spread");
- cache capacity (`capacity.py`): a new branch of shared content (a new conversation matching
  only its system prompt) does not go to a target whose cache is full of content still in use
  while another has room: it goes to a holder of the shared prefix with room, else the target
  with the most room, so a hot system prompt spreads over more targets and conversations
  group by system prompt;
- a prompt nobody was sent before is placed where every worker process and replica would place
  it: consistent hashing with bounded loads on its anchor (`placement.py`; the anchor of a
  long system prompt or document is its beginning, shared by all its conversations), so a
  conversation keeps meeting the server with its prefix across `--workers` and replicas, which
  share no routing history; once capacities are known, among the targets with the most room.

Decision, in order (costs and loads in load units, `load.py`):
1. load imbalance (max - min > `balance_abs_threshold` and max > min * `balance_rel_threshold`):
   of the targets whose cost is not clearly above the lowest (`move_factor`), the longest
   match (`load.cheapest`): a cached 16K document is not recomputed for a queue as long;
2. best match / key length >= `match_threshold`: of the best-matching servers (a continuation:
   those holding its previous turn; a new branch: those it fits on, or the target with the most
   room, `capacity.Capacity.allowed`), the first in ring order within the load bound, else the
   cheapest of them; then a new copy elsewhere if clearly cheaper (decision "spread");
3. a key of at least `placement_min` characters/tokens: its ring placement (bounded load:
   at most `1 + placement_epsilon` times the average) among the targets with the most room;
4. otherwise (short prompts, little to cache) the least loaded server (ties rotate).
Capacity unknown for any candidate (no `/v1/loads` yet, 0, no option), or nothing learned of
reuse yet: no capacity test (an unknown capacity is not guessed at: match and load decide).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.policies.base import Policy
from gateway.prefix.capacity import Capacity
from gateway.prefix.placement import Ring, anchor_of, first, place
from gateway.prefix.shared import SharedPrefixes, merged
from gateway.prefix.tree import CHARS_PER_TOKEN, Key, Match, PrefixTree
from gateway.request import RequestView
from gateway.scheduling.load import (
    LoadOptions,
    cheapest,
    counted_scores,
    imbalanced,
    load_scores,
    rotating_argmin,
    spread,
    with_uncached,
)
from gateway.servers.pool import Server

# Matches within this fraction of the best one count as equal (coincidental overlap).
TIE_BAND = 0.05
INF = float("inf")


@dataclass(frozen=True)
class CacheAwareOptions(LoadOptions):
    """Thresholds of the cache-or-load decision and the bound of the prefix tree."""

    # Fraction of the key that must be matched to follow the cache. 0.3 keeps a shared system
    # prompt of a third of the prompt sticky (its prefill is the saving), while short matches
    # (role markers, a greeting) do not override load; the balance guard caps the hot spots.
    match_threshold: float = 0.3
    balance_abs_threshold: float = 32.0  # load units (one request + one per token_unit tokens)
    balance_rel_threshold: float = 1.5
    max_tree_size: int = 1 << 26  # characters over all servers (a token counts 4; ~67 M)
    cache_tokens: int = 0  # prefix cache of a target (server or DP rank); 0: /v1/loads
    eviction_ttl: float = 0.0  # seconds an unused prefix is kept; 0: only the size bound evicts
    placement_min: int = 256  # key length (characters or tokens) placed on the ring
    placement_epsilon: float = 0.25  # a ring placement's load bound: (1 + eps) x average

    def validate(self) -> None:
        super().validate()
        if not 0.0 <= self.match_threshold <= 1.0:
            raise ValueError(
                f"option 'match_threshold' must be in [0, 1], got {self.match_threshold}"
            )
        if self.balance_abs_threshold < 0:
            raise ValueError(
                f"option 'balance_abs_threshold' must be >= 0, got {self.balance_abs_threshold}"
            )
        if self.balance_rel_threshold < 1.0:
            raise ValueError(
                f"option 'balance_rel_threshold' must be >= 1, got {self.balance_rel_threshold}"
            )
        if self.max_tree_size < 1:
            raise ValueError(f"option 'max_tree_size' must be >= 1, got {self.max_tree_size}")
        if self.cache_tokens < 0:
            raise ValueError(f"option 'cache_tokens' must be >= 0, got {self.cache_tokens}")
        if self.eviction_ttl < 0:
            raise ValueError(f"option 'eviction_ttl' must be >= 0, got {self.eviction_ttl}")
        if self.placement_min < 1:
            raise ValueError(f"option 'placement_min' must be >= 1, got {self.placement_min}")
        if self.placement_epsilon < 0:
            raise ValueError("option 'placement_epsilon' must be >= 0, "
                             f"got {self.placement_epsilon}")


class CacheAwarePolicy(Policy):
    name = "cache_aware"
    Options = CacheAwareOptions

    def __init__(self, role: str, options: CacheAwareOptions | None = None) -> None:
        super().__init__(role, options)
        self.tree = PrefixTree(self.options.max_tree_size, self.options.eviction_ttl)
        self._turn = 0
        self._decisions = {"cache": 0, "capacity": 0, "spread": 0, "load": 0, "balance": 0,
                           "placement": 0}
        self.ring = Ring()
        self.capacity = Capacity(self.options.cache_tokens)
        self._last_match: tuple[dict[str, int], int] = ({}, 0)
        self.prefixes: SharedPrefixes | None = None  # with --workers: the other processes'
        self._last_move: dict = {}  # what the latest move off a cache saw (stats: why)

    def share(self, prefixes: SharedPrefixes | None) -> None:
        self.prefixes = prefixes

    def match(self, key: Key, candidates: Sequence[Server]) -> Match:
        """What the tree knows of `key`, plus what the other worker processes recorded."""
        matched = self.tree.match(key)
        prefixes = self.prefixes
        if prefixes is None or not key or not prefixes.blocks(key):
            return matched
        found = prefixes.find(key, [w.url for w in candidates], time.monotonic(),
                              known=matched.end)
        return merged(matched, found)

    def learn(self, key: Key, server: Server) -> None:
        """`key` went to `server`: into the tree, and for the other worker processes."""
        self.tree.insert(key, server.url, budget=self.capacity.budget(server))
        if self.prefixes is not None:
            self.prefixes.record(key, server.url, time.monotonic())

    def pick(self, candidates: Sequence[Server], view: RequestView) -> Server:
        key = view.routing_key
        return self.choose(candidates, self.match(key, candidates), len(key), key)

    def choose(self, candidates: Sequence[Server], matched: Match, key_len: int,
               key: Key | None = None) -> Server:
        """The decision above, given each server's matched prefix length out of `key_len`."""
        options = self.options
        self._last_match = (matched, key_len)
        turn = self._turn
        self._turn += 1
        if len(candidates) == 1:
            return candidates[0]
        now = time.monotonic()
        scores = self.scores(candidates, now)
        lengths = [matched.get(w.url, 0) for w in candidates]
        unit = 1 if isinstance(key, str) else CHARS_PER_TOKEN
        if imbalanced(scores, options.balance_abs_threshold, options.balance_rel_threshold):
            costs = self._costs(scores, lengths, key_len, unit)
            self._decisions["balance"] += 1
            self._moved("balance", candidates, scores, costs, lengths)
            return candidates[cheapest(costs, lengths, options.move_factor, turn)]
        best = max(lengths)
        anchor = anchor_of(key) if key is not None else b""
        if best and key_len and best / key_len >= options.match_threshold:
            floor = best - best * TIE_BAND
            allowed, reason = self.capacity.allowed(self.tree, candidates, matched, lengths,
                                                    floor, unit, key_len, now)
            order = self.ring.order(anchor, candidates)
            chosen = first(order, scores, options.placement_epsilon, allowed)
            costs = None  # what each target would cost, asked only when a choice needs it
            if chosen is None:  # every holder over the bound: the cheapest of them
                costs = self._costs(scores, lengths, key_len, unit)
                chosen = rotating_argmin([c if ok else INF for c, ok in
                                          zip(costs, allowed, strict=True)], turn)
            if min(lengths) < floor:  # a candidate without the prefix: a new copy may pay
                if costs is None:
                    costs = self._costs(scores, lengths, key_len, unit)
                copy = spread(order, costs, [n < floor for n in lengths], chosen,
                              options.move_factor)
                if copy is not None:
                    reason, chosen = "spread", copy
                    self._moved(reason, candidates, scores, costs, lengths)
            self._decisions[reason] += 1
            return candidates[chosen]
        if key is not None and key_len >= options.placement_min:
            room = self.capacity.placeable(self.tree, candidates, key_len * unit, now)
            placed = place(self.ring.order(anchor, candidates), scores,
                           options.placement_epsilon, room)
            if placed is not None:
                self._decisions["placement"] += 1
                return candidates[placed]
            if room is not None:
                scores = [s if ok else INF for s, ok in zip(scores, room, strict=True)]
        self._decisions["load"] += 1
        return candidates[rotating_argmin(scores, turn)]

    def _costs(self, scores: list[float], lengths: list[int], key_len: int,
               unit: int) -> list[float]:
        """Each target's cost of this request: its load plus the request's uncached part
        there (`load.with_uncached`)."""
        return with_uncached(scores, lengths, key_len, key_len * unit / CHARS_PER_TOKEN,
                             self.options.token_unit)

    def _moved(self, reason: str, candidates: Sequence[Server], scores: list[float],
               costs: list[float], lengths: list[int]) -> None:
        """Keep what a load-driven decision saw, for `stats`: an operator asking why a
        conversation left its cache finds the loads that moved it (a rare path: no cost)."""
        self._last_move = {"reason": reason, "at": round(time.time(), 3), "targets": [
            {"url": w.url, "load": round(s, 3), "cost": round(c, 3), "matched": n}
            for w, s, c, n in zip(candidates, scores, costs, lengths, strict=True)]}

    def scores(self, candidates: Sequence[Server], now: float) -> list[float]:
        """Load scores (gateway/scheduling/load.py). With `--workers`, on this gateway's
        counters alone (every worker's, summed: exact and immediate): a `/v1/loads` snapshot
        still counts the other workers' requests that ended since it was taken (a process
        takes only its own off it), so the server that had just answered a conversation's
        turn looked busy to the worker that got the next turn, which moved the conversation
        off its cache (0.821 against 0.873 with one worker; docs/WORKERS.md)."""
        if self.prefixes is None:
            return load_scores(candidates, self.options, now)
        return counted_scores(candidates, self.options.token_unit, now)

    def predicted_hit(self, server: Server, view: RequestView) -> float | None:
        matched, key_len = self._last_match
        return matched.get(server.url, 0) / key_len if key_len else None

    def on_dispatch(self, server: Server, view: RequestView) -> None:
        key: Key = view.routing_key
        if key:
            self.learn(key, server)

    def on_servers_changed(self, servers: Sequence[Server]) -> None:
        present = {w.url for w in servers}
        self.ring.rebuild(sorted(present))
        for url in set(self.tree.server_sizes()) - present:
            self.tree.remove_server(url)

    def stats(self) -> dict:
        return {
            "tree_size": self.tree.size,
            "tree_max_size": self.tree.max_size,
            "tree_nodes": self.tree.node_count,
            "tree_size_by_worker": self.tree.server_sizes(),
            "decisions": dict(self._decisions),
            "last_move": self._last_move,
            "reuse_interval_s": round(self.capacity.reuse, 3),
            "branch_growth_tokens": round(self.capacity.growth() / CHARS_PER_TOKEN),
        }
