"""Pair selection: filter usable servers, then ask the prefill and decode policies.

A pair is chosen only when BOTH roles have a usable server, so one leg is never sent alone.
On a retry the servers that just failed are avoided while others remain.

Pairs: a (prefill, decode) pair quarantined for failing on its own (gateway/health/pairs.py)
is not chosen while the prefill has another usable partner.

DP ranks: a prefill server with several DP ranks is offered to the prefill policy as its
ranks (`servers.Rank`), each with its own load and its own prefix state, so a cache-aware
choice picks the rank that holds the prefix, and a load-aware one spreads over all ranks
(left to the room number, rooms stepping by one over alternating servers would leave half
the ranks idle). The dispatcher
then steers the request to that rank. Decode ranks are left to the decode server: its own
DataParallelController balances them (round robin by default) with figures the gateway
only sees late, and what the decode caches is what the prefill sends it.

Models: the candidates of both roles are the servers of the request's model only
(`gateway/scheduling/models.py`), and each model's own policies choose among them, so a
prefill of one model is never paired with a decode of another and no policy state mixes
models.

Sessions: a request with a session id (`--session-header`) takes its prefill target from
`affinity.SessionAffinity` instead of the prefill policy (which still hears of the dispatch);
`by_policy` says whether a pick's prefill was the policy's own choice. The affinity ring
holds every prefill target; it places a session among the candidates only, so one ring serves
every model.

Joint choice: a prefill policy may choose the pair itself (`Policy.pick_pair`, the `slo`
policy: predicted TTFT and ITL of each pair against the request's objectives); then the
decode policy is not asked, and quarantined pairs are left out by that policy (it is given
`PairHealth.blocked`). `forecast` gives the SLO gate the best forecast without picking.
"""

from __future__ import annotations

import time
from collections.abc import Collection

from gateway.errors import ServiceUnavailable
from gateway.health.pairs import PairHealth
from gateway.policies import Policy
from gateway.request import RequestView
from gateway.scheduling.affinity import SessionAffinity
from gateway.scheduling.models import Model, Models, Target, targets
from gateway.servers.breaker import OPEN
from gateway.servers.pool import Server, ServerPool


class Scheduler:
    def __init__(self, pool: ServerPool, models: Models, pairs: PairHealth | None = None,
                 affinity: SessionAffinity | None = None) -> None:
        self.pool = pool
        self.models = models
        self.affinity = affinity
        self.pairs = pairs or PairHealth()
        self.panics = {"prefill": 0, "decode": 0}  # picks made in panic mode, per role
        pool.on_change(self.servers_changed)
        self.servers_changed()

    @property
    def policies(self) -> dict[str, Policy]:
        """The default model's policies, by role (what status pages show first)."""
        return self.models.shown().policies

    def policies_of(self, server: Server) -> dict[str, Policy]:
        """The policies of the server's model, by role (`Models.policies_of`)."""
        return self.models.policies_of(server)

    def servers_changed(self) -> None:
        """Regroup the servers by model and tell each model's policies (and the session
        ring) its servers (membership or probed details changed)."""
        self.models.regroup()
        if self.affinity is not None:
            self.affinity.on_servers_changed(targets(self.pool.role("prefill")))

    def candidates(self, role: str, view: RequestView, avoid: Collection[Server],
                   model: Model | None = None) -> list[Server]:
        """Usable servers of `role` of the request's model (not just failed); with none
        usable, the ones that can still take a request (panic routing, as Envoy does below
        its panic threshold, where health is ignored): healthy ones with an open or busy
        half-open breaker, else the ones its health checks marked down that still accept
        connections (`Server.in_pool`): a suspect or silent server is better than a 503. A
        server that stalls for seconds (an SGLang decode under load, /health included) is
        marked down yet often answers again a moment later; refusing every request of that
        stall would fail requests it could serve. A request sent to a stalled server waits
        within its own deadlines (gateway/dispatch/pd.py); one whose server refuses
        connections is not sent (503 at once).

        Trust, in this order: usable servers that are not suspected hung; when every one of
        them is a suspect or just failed this request (`avoid`), a server whose health checks
        pass but whose breaker is still open from earlier failures (recovering): the request
        is its probe, and a success closes the breaker; else the suspects themselves."""
        now = time.monotonic()
        members = (model or self.models.of(view)).servers[role]
        ready = []  # usable and not suspected: the usual pick's answer, in one pass
        for w in members:
            breaker = w.breaker
            if breaker.state is OPEN:  # cooldown over: half-open (the one place this happens)
                breaker.refresh(now)
            if w.usable and w.suspect_until <= now:
                ready.append(w)
        if ready and not avoid:
            return ready
        servers = [w for w in members if w.usable]
        if not servers:
            servers = [w for w in members if w.serving] or [w for w in members if w.in_pool]
            if servers:
                self.panics[role] += 1
        cornered = False  # every candidate just failed this request
        if avoid:
            fresh = [w for w in servers if w not in avoid]
            cornered = not fresh
            if fresh:
                servers = fresh
        trusted = [w for w in servers if w.suspect_until <= now]
        if trusted and not cornered:  # a suspected hang: new requests keep off it
            return trusted
        recovering = [w for w in members if w.serving and w.suspect_until <= now
                      and w not in servers and w not in avoid]
        return recovering or trusted or servers

    def pick(self, view: RequestView, avoid: Collection[Server] = (),
             prefer: tuple[Server, int | None] | None = None) -> tuple[Target, Server]:
        """A (prefill target, decode) pair; the target is a server or one of its DP ranks.
        `prefer` names a prefill (and rank) to take while it is a candidate (the samples
        of one request follow the first to its cached prompt)."""
        model = self.models.of(view)
        prefills = self.candidates("prefill", view, avoid, model)
        decodes = self.candidates("decode", view, avoid, model)
        if not prefills or not decodes:
            missing = " and ".join(
                role for role, found in (("prefill", prefills), ("decode", decodes)) if not found
            )
            of_model = "" if self.models.open else f" of model {model.name!r}"
            raise ServiceUnavailable(
                f"no usable {missing} server{of_model} (all down, draining or circuit-open)",
                headers={"retry-after": "1"},
            )
        if prefer is not None and prefer[0] in prefills:
            preferred, rank = prefer
            prefill = preferred.ranks[rank] if rank is not None and rank < len(preferred.ranks) \
                else preferred
        elif view.session is not None and self.affinity is not None:
            prefill = self.affinity.pick(view.session, targets(prefills))
        else:
            chooser, choices = model.policies["prefill"], targets(prefills)
            pair = chooser.pick_pair(choices, decodes, view, self.pairs.blocked)
            if pair is not None:  # a joint policy (gateway/policies/slo.py)
                self.pairs.probe(pair[0].server.url, pair[1].url)
                return pair
            prefill = chooser.pick(choices, view)
        prefill_url = prefill.server.url
        partners = self.pairs.partners(prefill_url, decodes)
        decode = model.policies["decode"].pick(partners or decodes, view)
        self.pairs.probe(prefill_url, decode.url)  # a quarantined pair past its cooldown: a probe
        return prefill, decode

    def forecast(self, view: RequestView):
        """The best latency forecast any usable pair offers `view` now (the SLO gate's
        question); None: no pair, or the model's prefill policy makes no forecasts."""
        model = self.models.of(view)
        prefills = self.candidates("prefill", view, (), model)
        decodes = self.candidates("decode", view, (), model)
        if not prefills or not decodes:
            return None
        return model.policies["prefill"].forecast(targets(prefills), decodes, view,
                                                  self.pairs.blocked)

    def learns_from_every_request(self, view: RequestView) -> bool:
        """Whether the prefill policy of `view`'s model learns from a request without
        objectives (`Policy.learns_from_every_request`): the SLO gate's ticket for it."""
        return self.models.of(view).policies["prefill"].learns_from_every_request

    def by_policy(self, view: RequestView, prefill: Target,
                  prefer: tuple[Server, int | None] | None) -> bool:
        """Was `prefill`, as `pick(view, ..., prefer)` returned it, the prefill policy's own
        choice (not the preferred server of a sample, nor a session's)?"""
        if prefer is not None and prefill.server is prefer[0]:
            return False  # `pick` takes a preferred server whenever it is a candidate
        return view.session is None or self.affinity is None

