"""Pair selection: filter usable workers, then ask the prefill and decode policies.

A pair is chosen only when BOTH roles have a usable worker, so one leg is never sent alone.
On a retry the workers that just failed are avoided while others remain.

Pairs: a (prefill, decode) pair quarantined for failing on its own (gateway/pairs.py) is not
chosen while the prefill has another usable partner.

DP ranks: a prefill server with several DP ranks is offered to the prefill policy as its
ranks (`workers.Rank`), each with its own load and its own prefix state, so a cache-aware
choice picks the rank that holds the prefix, and a load-aware one spreads over all ranks
(rooms stepping by one over alternating servers left half the ranks idle). The dispatcher
then steers the request to that rank. Decode ranks are left to the decode server: its own
DataParallelController balances them (round robin by default) with figures the gateway
only sees late, and what the decode caches is what the prefill sends it.

Sessions: a request with a session id (`--session-header`) takes its prefill target from
`affinity.SessionAffinity` instead of the prefill policy (which still hears of the dispatch);
`by_policy` says whether the last prefill choice was the policy's own.
"""

from __future__ import annotations

import time
from collections.abc import Collection

from gateway.affinity import SessionAffinity
from gateway.errors import ServiceUnavailable
from gateway.pairs import PairHealth
from gateway.policies import Policy
from gateway.request import RequestView
from gateway.workers import Rank, Worker, WorkerPool

Target = Worker | Rank


def targets(workers: list[Worker]) -> list[Target]:
    """What the prefill policy chooses among: each server, or each of its DP ranks."""
    out: list[Target] = []
    for worker in workers:
        if worker.ranks:
            out.extend(worker.ranks)
        else:
            out.append(worker)
    return out


class Scheduler:
    def __init__(self, pool: WorkerPool, prefill_policy: Policy, decode_policy: Policy,
                 pairs: PairHealth | None = None, affinity: SessionAffinity | None = None
                 ) -> None:
        self.pool = pool
        self.affinity = affinity
        self.by_policy = True
        self.pairs = pairs or PairHealth()
        self.policies = {"prefill": prefill_policy, "decode": decode_policy}
        self.panics = {"prefill": 0, "decode": 0}  # picks made in panic mode, per role
        pool.on_change(self.workers_changed)
        self.workers_changed()

    def workers_changed(self) -> None:
        """Tell the policies the current workers (membership or probed details changed)."""
        prefills = targets(self.pool.role("prefill"))
        self.policies["prefill"].on_workers_changed(prefills)
        if self.affinity is not None:
            self.affinity.on_workers_changed(prefills)
        self.policies["decode"].on_workers_changed(self.pool.role("decode"))

    def candidates(self, role: str, view: RequestView, avoid: Collection[Worker]) -> list[Worker]:
        """Usable workers of `role` (right model, not just failed); with none usable, the
        ones that can still take a request: healthy, but with an open or busy half-open
        breaker (panic routing, as Envoy does below its panic threshold): a suspect server
        is better than a 503."""
        self.pool.refresh_breakers(role)
        workers = self.pool.usable(role)
        if not workers:
            workers = self.pool.panic(role)
            if workers:
                self.panics[role] += 1
        if view.model is not None:
            same_model = [w for w in workers if w.model == view.model]
            if same_model:
                workers = same_model
        if avoid:
            fresh = [w for w in workers if w not in avoid]
            if fresh:
                workers = fresh
        now = time.monotonic()
        if any(w.suspect_until > now for w in workers):
            trusted = [w for w in workers if w.suspect_until <= now]
            if trusted:  # a suspected hang: keep new requests off it while others can serve
                workers = trusted
        return workers

    def pick(self, view: RequestView, avoid: Collection[Worker] = (),
             prefer: tuple[Worker, int | None] | None = None) -> tuple[Target, Worker]:
        """A (prefill target, decode) pair; the target is a server or one of its DP ranks.
        `prefer` names a prefill (and rank) to take while it is a candidate (the samples
        of one request follow the first to its cached prompt)."""
        prefills = self.candidates("prefill", view, avoid)
        decodes = self.candidates("decode", view, avoid)
        if not prefills or not decodes:
            missing = " and ".join(
                role for role, found in (("prefill", prefills), ("decode", decodes)) if not found
            )
            raise ServiceUnavailable(
                f"no usable {missing} server (all down, draining or circuit-open)",
                headers={"retry-after": "1"},
            )
        self.by_policy = False
        if prefer is not None and prefer[0] in prefills:
            worker, rank = prefer
            prefill = worker.ranks[rank] if rank is not None and rank < len(worker.ranks) \
                else worker
        elif view.session is not None and self.affinity is not None:
            prefill = self.affinity.pick(view.session, targets(prefills))
        else:
            prefill = self.policies["prefill"].pick(targets(prefills), view)
            self.by_policy = True
        server = prefill.server.url
        partners = [d for d in decodes if not self.pairs.blocked(server, d.url)]
        decode = self.policies["decode"].pick(partners or decodes, view)
        self.pairs.probe(server, decode.url)  # a quarantined pair past its cooldown: a probe
        return prefill, decode

    def dispatched(self, prefill: Target, decode: Worker, view: RequestView) -> None:
        self.policies["prefill"].on_dispatch(prefill, view)
        self.policies["decode"].on_dispatch(decode, view)

    def completed(self, role: str, worker: Target, view: RequestView, success: bool) -> None:
        self.policies[role].on_complete(worker, view, success)
