"""Session affinity: the requests of one conversation (`--session-header`) keep their prefill.

Why: a conversation's next turn extends its previous prompt, so the prefill that served the
last turn holds most of the next one's KV in its prefix cache. The cache-aware policies find
that server from the prompt itself; a session id says it outright, also for prompts whose
beginning changes (a rewritten system prompt, summarised history) and across gateway
processes and replicas, which share no routing history.

The choice, for a request carrying session id S, among the usable prefill targets (servers or
DP ranks, as the prefill policy sees them):

1. S's remembered target, if it is still a candidate and not overloaded: `kept`.
   Overloaded is the cache_aware balance guard (`load.imbalanced`) between it and the least
   loaded candidate: its load exceeds the least loaded one's by more than
   `balance_abs_threshold` load units AND by more than `balance_rel_threshold` times (load
   units as in scheduling/load.py: one per request in flight, one per 512 prompt tokens, 32
   for a full KV pool). The thresholds are `cache_aware`'s defaults (`CacheAwareOptions`), so
   a session leaves its server where cache_aware would send a request elsewhere.
2. Otherwise S is hashed onto the ring of targets (prefix/placement.py, consistent hashing
   with bounded loads: the first target clockwise whose load is at most
   `1 + placement_epsilon` times the average, cache_aware's default too): `placed` for a new
   (or expired) session, `moved` when its target became unusable or overloaded. The new
   target is remembered.

Every worker process and every replica computes the same ring from the same servers and S's
bytes, so without sharing any state they send a new session to the same server and agree
again after a move (the bound reads loads that every process sees alike: in-flight counts
summed over workers, the servers' /v1/loads). What is remembered is per process: a session
moved by one process's view of an overload stays moved there until it expires.

Memory: at most `capacity` sessions per process (least recently used dropped first), each
forgotten `ttl` seconds after its last request; a session costs one dict entry keyed by a
64-bit hash of its id (ids are at most 256 bytes, never stored).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from gateway.policies.cache_aware import CacheAwareOptions
from gateway.prefix.placement import Ring, place
from gateway.scheduling.load import imbalanced, load_scores

OUTCOMES = ("kept", "placed", "moved")


def overloaded(scores: Sequence[float], index: int, options: CacheAwareOptions) -> bool:
    """cache_aware's imbalance guard between one candidate and the least loaded."""
    return imbalanced((min(scores), scores[index]), options.balance_abs_threshold,
                      options.balance_rel_threshold)


class SessionAffinity:
    """Remembered prefill targets per session, with the ring for new and moved sessions."""

    def __init__(self, capacity: int, ttl: float, counters: dict | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = capacity
        self.ttl = ttl
        self._clock = clock
        self._memory: OrderedDict[int, tuple[str, float]] = OrderedDict()  # hash -> (url, t)
        self.ring = Ring()
        self._options = CacheAwareOptions()  # load scores and guard thresholds
        self.counters = counters or {}  # outcome -> BufferedCounter (metrics)
        self.counts = dict.fromkeys(OUTCOMES, 0)

    @classmethod
    def from_config(cls, config, metrics) -> SessionAffinity | None:
        """The gateway's affinity, or None without `--session-header`."""
        if not config.session_header:
            return None
        counters = {outcome: metrics.buffered_counter(metrics.session_picks.labels(outcome))
                    for outcome in OUTCOMES}
        return cls(config.session_capacity, config.session_ttl, counters)

    def __len__(self) -> int:
        return len(self._memory)

    def on_servers_changed(self, targets: Sequence) -> None:
        self.ring.rebuild(sorted(t.url for t in targets))

    def pick(self, session: bytes, candidates: Sequence):
        """The target for a request of `session` among `candidates` (never empty)."""
        now = self._clock()
        key = hash(session)
        scores = load_scores(candidates, self._options, now)
        memory = self._memory
        remembered = memory.get(key)
        outcome = "placed"
        if remembered is not None and now - remembered[1] <= self.ttl:
            url = remembered[0]
            for index, candidate in enumerate(candidates):
                if candidate.url == url:
                    if not overloaded(scores, index, self._options):
                        memory[key] = (url, now)
                        memory.move_to_end(key)
                        self._count("kept")
                        return candidate
                    if len(candidates) > 1:  # overloaded: the ring among the others
                        candidates = [*candidates[:index], *candidates[index + 1:]]
                        scores = [*scores[:index], *scores[index + 1:]]
                    break
            outcome = "moved"
        index = place(self.ring.order(session, candidates), scores,
                      self._options.placement_epsilon)
        if index is None:  # not on the ring yet (a target just added): the least loaded
            index = min(range(len(scores)), key=scores.__getitem__)
        chosen = candidates[index]
        memory[key] = (chosen.url, now)
        memory.move_to_end(key)
        while len(memory) > self.capacity:
            memory.popitem(last=False)  # the least recently used
        for _ in range(2):  # expired ones, a few per new choice (never one long stall)
            if now - next(iter(memory.values()))[1] <= self.ttl:
                break
            memory.popitem(last=False)
        self._count(outcome)
        return chosen

    def _count(self, outcome: str) -> None:
        self.counts[outcome] += 1
        counter = self.counters.get(outcome)
        if counter is not None:
            counter.inc()
