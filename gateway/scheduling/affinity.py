"""Session affinity: the requests of one conversation (`--session-header`) keep their prefill.

Why: a conversation's next turn extends its previous prompt, so the prefill that served the
last turn holds most of the next one's KV in its prefix cache. The cache-aware policies find
that server from the prompt itself; a session id says it outright, also for prompts whose
beginning changes (a rewritten system prompt, summarised history) and across gateway
processes and replicas, which share no routing history.

The choice, for a request carrying session id S, among the usable prefill targets (servers or
DP ranks, as the prefill policy sees them):

1. S's remembered target, if it is still a candidate and not overloaded: `kept`.
   Overloaded is the cache_aware balance guard applied to it: its load exceeds the least
   loaded candidate's by more than `BALANCE_ABS` load units AND by more than `BALANCE_REL`
   times (load units as in policies/load.py: one per request in flight, one per 512 prompt
   tokens, 32 for a full KV pool; the same defaults as `cache_aware`).
2. Otherwise S is hashed onto the ring of targets (policies/placement.py, consistent hashing
   with bounded loads: the first target clockwise whose load is at most `1 + EPSILON` times
   the average): `placed` for a new (or expired) session, `moved` when its target became
   unusable or overloaded. The new target is remembered.

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

from gateway.prefix.placement import Ring
from gateway.scheduling.load import LoadOptions, load_scores

BALANCE_ABS = 32.0  # load units (cache_aware's balance_abs_threshold)
BALANCE_REL = 1.5  # cache_aware's balance_rel_threshold
EPSILON = 0.25  # a ring placement's load bound, as cache_aware's placement_epsilon
OUTCOMES = ("kept", "placed", "moved")


def overloaded(scores: Sequence[float], index: int) -> bool:
    """cache_aware's imbalance guard for one candidate against the least loaded."""
    low, mine = min(scores), scores[index]
    return mine - low > BALANCE_ABS and mine > low * BALANCE_REL


class SessionAffinity:
    """Remembered prefill targets per session, with the ring for new and moved sessions."""

    def __init__(self, capacity: int, ttl: float, counters: dict | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = capacity
        self.ttl = ttl
        self._clock = clock
        self._memory: OrderedDict[int, tuple[str, float]] = OrderedDict()  # hash -> (url, t)
        self.ring = Ring()
        self._options = LoadOptions()
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
                    if not overloaded(scores, index):
                        memory[key] = (url, now)
                        memory.move_to_end(key)
                        self._count("kept")
                        return candidate
                    if len(candidates) > 1:  # overloaded: the ring among the others
                        candidates = [*candidates[:index], *candidates[index + 1:]]
                        scores = [*scores[:index], *scores[index + 1:]]
                    break
            outcome = "moved"
        index = self.ring.place(session, candidates, scores, EPSILON)
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
