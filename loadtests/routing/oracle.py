"""The sticky oracle: a client-side PD router that knows the workload's structure.

What it knows, from the plan before the run starts: which shared prefix (system prompt,
document, few-shot prefix, agent kind) each session uses, how many requests each session will
send, the prefix sizes, and each prefill server's cache size. What it does with that:

1. *Replicas per prefix* (`replicas`): every prefix group gets the fewest servers that bring
   the busiest server's planned share of requests down (water filling: a replica is added to
   the largest group on the busiest server while that lowers the maximum), placed largest piece
   first on the least loaded server, and never more prefixes on a server than fit in
   `ROOM` of its cache when another server has room (the rest of the cache is for the
   sessions' own tokens). Loads are compared busiest first, so a replica that leaves the
   maximum but lowers the next busiest server is taken too.
2. *Sticky sessions* (`assign`): each session, in arrival order, goes to the replica of its
   group with the fewest planned requests so far, and stays there. So every request finds its
   session's previous prompt and its group's prefix on its server, except the first request
   of a group on each replica.
3. *PD pairing* as a proxy does it (`loadtests/routes.py`): a fresh bootstrap room, the
   prefill's bootstrap address, both legs at once; the decode with the fewest of the oracle's
   own requests in flight.

It has no proxy process and no routing cost, so its TTFT is a floor of sorts too. Its hit
ratio is the reference of "what routing could reach", not a proof of optimality: a router
that piles everything onto fewer servers can reuse a prefix a little more (fewer replicas),
and one that watches the caches can avoid evictions the plan-time assignment does not see.
Plans without shared structure (unrelated prompts) have no oracle; DP ranks are not steered.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import orjson

from loadtests.client import Connection, ReplyError, post
from loadtests.routes import HOST, both_legs, new_rooms, pd_fields
from loadtests.routing.client import Reply, stream
from loadtests.routing.cluster import Cluster
from loadtests.routing.hard_workloads import AgentPlan
from loadtests.routing.workloads import ChatPlan, FewshotPlan

ROOM = 0.85  # share of a server's cache the placed prefixes may fill


@dataclass(frozen=True)
class Structure:
    """What the oracle reads from a plan."""

    groups: tuple[int, ...]  # per session (plan order), its prefix group
    requests: tuple[int, ...]  # per session, the requests it will send
    prefix_tokens: dict[int, int]  # per group, its shared prefix in tokens


def structure(plan: object) -> Structure | None:
    """The plan's sessions and shared prefixes; None when it has none (no oracle there)."""
    if isinstance(plan, ChatPlan):
        sizes = {g: len(c.system) // 4 for g, c in zip(plan.system_of, plan.conversations,
                                                       strict=True)}
        return Structure(plan.system_of, tuple(len(c.users) for c in plan.conversations), sizes)
    if isinstance(plan, AgentPlan):
        sizes = {s.kind: plan.shape.system_tokens for s in plan.sessions}
        return Structure(tuple(s.kind for s in plan.sessions),
                         tuple(s.steps for s in plan.sessions), sizes)
    if isinstance(plan, FewshotPlan):
        groups = tuple(r.prefix for r in plan.requests)
        return Structure(groups, (1,) * len(groups),
                         dict.fromkeys(groups, plan.shape.prefix_tokens))
    return None


def _place(weight: dict[int, float], counts: dict[int, int], prefix: dict[int, int],
           servers: int, room: float) -> dict[int, list[int]]:
    load, held = [0.0] * servers, [0] * servers
    out: dict[int, list[int]] = {g: [] for g in weight}
    pieces = sorted(((weight[g] / counts[g], g) for g in weight for _ in range(counts[g])),
                    key=lambda p: (-p[0], p[1]))
    for share, group in pieces:
        free = [s for s in range(servers) if s not in out[group]]
        fits = [s for s in free if held[s] + prefix[group] <= room] or free
        server = min(fits, key=lambda s: (load[s], s))
        out[group].append(server)
        load[server] += share
        held[server] += prefix[group]
    return out


def _loads(placed: dict[int, list[int]], weight: dict[int, float], servers: int) -> list[float]:
    load = [0.0] * servers
    for group, where in placed.items():
        for server in where:
            load[server] += weight[group] / len(where)
    return load


def _worse_or_equal(trial: list[float], now: list[float]) -> bool:
    """Loads compared busiest first: a trial must lower the first that differs."""
    for a, b in zip(sorted(trial, reverse=True), sorted(now, reverse=True), strict=True):
        if abs(a - b) > 1e-9:
            return a > b
    return True


def replicas(weight: dict[int, float], prefix: dict[int, int], servers: int,
             cache_tokens: int) -> dict[int, list[int]]:
    """The servers of each group (step 1 of the module docstring)."""
    room = ROOM * cache_tokens
    counts = dict.fromkeys(weight, 1)
    best = _place(weight, counts, prefix, servers, room)
    while True:
        loads = _loads(best, weight, servers)
        hottest = max(range(servers), key=lambda s: loads[s])
        growable = [g for g, where in best.items() if hottest in where and counts[g] < servers]
        if not growable:
            return best
        group = max(growable, key=lambda g: (weight[g] / counts[g], -g))
        trial_counts = {**counts, group: counts[group] + 1}
        trial = _place(weight, trial_counts, prefix, servers, room)
        if _worse_or_equal(_loads(trial, weight, servers), loads):
            return best
        counts, best = trial_counts, trial


def assign(plan_structure: Structure, servers: int, cache_tokens: int) -> list[int]:
    """Per session, its prefill server index (step 2 of the module docstring)."""
    total = sum(plan_structure.requests) or 1
    weight: dict[int, float] = {}
    for group, requests in zip(plan_structure.groups, plan_structure.requests, strict=True):
        weight[group] = weight.get(group, 0.0) + requests / total
    where = replicas(weight, plan_structure.prefix_tokens, servers, cache_tokens)
    given = [0] * servers
    out = []
    for group, requests in zip(plan_structure.groups, plan_structure.requests, strict=True):
        server = min(where[group], key=lambda s: (given[s], s))
        given[server] += requests
        out.append(server)
    return out


class Oracle:
    """A `drive.Send` that routes each session to its assigned prefill server."""

    def __init__(self, cluster: Cluster, plan: object, timeout: float) -> None:
        found = structure(plan)
        if found is None:
            raise ValueError("the oracle needs a plan with shared prefixes and sessions")
        if cluster.options.dp_ranks != 1:
            raise ValueError("the oracle does not steer DP ranks")
        self.prefills = [(s.port, s.bootstrap_port or 0) for s in cluster.prefills]
        if not all(bootstrap for _, bootstrap in self.prefills):
            raise ValueError("every prefill server needs a bootstrap port")
        self.decodes = [s.port for s in cluster.decodes]
        self.server_of = assign(found, len(cluster.prefills), cluster.options.cache_tokens)
        self.timeout = timeout
        self.rooms = new_rooms()
        self.decode_busy = [0] * len(self.decodes)

    async def send(self, path: str, body: dict, key: int) -> Reply:
        port, bootstrap = self.prefills[self.server_of[key]]
        index = min(range(len(self.decodes)), key=lambda d: (self.decode_busy[d], d))
        full = pd_fields(body, bootstrap, next(self.rooms))
        self.decode_busy[index] += 1
        try:
            return await both_legs(self._prefill(port, path, full),
                                   stream(self.decodes[index], path, full, self.timeout))
        except (ReplyError, OSError, TimeoutError) as exc:
            return Reply(error=f"prefill leg: {exc}"[:200])
        finally:
            self.decode_busy[index] -= 1

    async def _prefill(self, port: int, path: str, body: dict) -> None:
        conn = Connection(HOST, port)
        try:
            async with asyncio.timeout(self.timeout):
                await conn.send(post(HOST, port, path, orjson.dumps(body)))
        finally:
            conn.close()
