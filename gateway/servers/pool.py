"""Servers (one backend server each) and the pool the scheduler picks from.

A server is *usable* for new work only when its health checks pass, its circuit breaker
allows a request and it is not draining. Counters are plain ints updated on the event loop.
"""

from __future__ import annotations

import contextlib
import ipaddress
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from gateway.servers.breaker import CLOSED, HALF_OPEN, OPEN, BreakerState, CircuitBreaker
from gateway.servers.load import ServerLoad, load_entry
from gateway.servers.probe import ServerFacts

ROLES = ("prefill", "decode")


def bootstrap_host_of(url: str) -> str:
    """The host part SGLang expects in `bootstrap_host`: IPv6 literals in brackets."""
    host = urlsplit(url).hostname or ""
    with contextlib.suppress(ValueError):
        if isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address):
            return f"[{host}]"
    return host


class Counted:
    """The in-flight counters of what a policy picks (a Server, or one of its DP ranks):
    taken as a request is sent there, given back as it ends. The fields are the subclass's."""

    __slots__ = ()
    in_flight: int
    in_flight_tokens: int
    total_requests: int

    def start(self, tokens: int) -> None:
        self.in_flight += 1
        self.in_flight_tokens += tokens
        self.total_requests += 1

    def finish(self, tokens: int, success: bool | None = None) -> bool:
        """Give the counters back; True when the outcome opened a breaker (a rank has none:
        its server's breaker takes the outcome)."""
        self.in_flight -= 1
        self.in_flight_tokens -= tokens
        return False


@dataclass(eq=False)
class Rank(Counted):
    """One DP rank of a server: what the prefill policies score when a server has several.

    SGLang runs one scheduler per DP rank, each with its own queue and radix cache, so a
    prefix is cached on a (server, rank), not on a server. A Rank looks like a Server to the
    policies (`url` is its own key, `server#dpN`; load and in-flight counters are its own);
    `server` is the Server it belongs to and `rank` its index.
    """

    server: Server
    rank: int
    url: str = ""
    in_flight: int = 0
    in_flight_tokens: int = 0
    total_requests: int = 0
    load: ServerLoad = field(default_factory=ServerLoad)

    def __post_init__(self) -> None:
        self.url = f"{self.server.url}#dp{self.rank}"

    @property
    def role(self) -> str:
        return self.server.role

    @property
    def model(self) -> str | None:
        return self.server.model

    def totals(self) -> tuple[int, int]:
        """In-flight requests and prompt tokens (this process's view of the rank)."""
        return self.in_flight, self.in_flight_tokens

    def working(self, now: float | None = None) -> tuple[int, int]:
        """`totals`: a trailing leg left its rank already (`Attempt.release_rank`)."""
        return self.totals()


# slots: a Server holds 33 fields, past the 30 keys up to which CPython 3.11 shares an
# instance dict's keys; with a dict every attribute read of a server got slower (about 1% of
# a request's instructions, docs/BENCHMARKS.md "Where the instructions went")
@dataclass(eq=False, slots=True)
class Server(Counted):
    url: str
    role: str
    bootstrap_port: int | None = None
    model: str | None = None
    dp_size: int = 1
    healthy: bool = True
    draining: bool = False
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    in_flight: int = 0
    in_flight_tokens: int = 0
    total_requests: int = 0
    total_failures: int = 0
    load: ServerLoad = field(default_factory=ServerLoad)
    bootstrap_host: str = ""
    verified: bool = False  # role and bootstrap port confirmed by /server_info
    misconfigured: str | None = None  # why the server can never be used (role mismatch)
    refused: bool = False  # its last health check was refused a connection: nothing listens
    held_out: bool = False  # launched: its process crashed, out until the launcher says ready
    last_success: float = 0.0  # monotonic time of the last successful request
    kv_events: dict | None = None  # the server's KV event publisher (/server_info kv_events)
    load_balance_method: str = "follow_bootstrap_room"  # how the server picks a DP rank
    context_length: int | None = None  # the model's, from /server_info
    max_input_length: int | None = None  # prompts must be shorter (/server_info)
    priority_scheduling: bool = False  # the server schedules by `priority` (/server_info)
    low_priority_first: bool = False  # ... lower values first
    ranks: list[Rank] = field(default_factory=list)  # DP ranks, when it has more than one
    # prefill legs of this process in `in_flight` whose KV is at their decode, their answer
    # still to come (`trail`), and their tokens: legs, but no load (`working`)
    trailing: int = 0
    trailing_tokens: int = 0
    attempts: set = field(default_factory=set)  # attempts waiting on this server now (rescue)
    suspect_until: float = 0.0  # a request here timed out without progress: avoid until then
    # times its health checks found it back (marked up again, or probed again after it
    # refused connections: restarted); a pair quarantined before that is probed at once
    # (gateway/health/pairs.py)
    comebacks: int = 0
    # the operator gave its bootstrap port (else the one its /server_info says is kept, and
    # learned again when it is probed again: restarted, it may listen on another)
    port_given: bool = field(default=False, init=False)
    shared: object = None  # processes.shared_state.ServerShare with --workers: counts summed
    metric_children: dict = field(default_factory=dict)  # labelled metrics, resolved once
    # as a scheduling target (like a Rank): the server it belongs to, its own; no DP rank.
    # Attributes, not properties: every pick reads them
    server: Server = field(init=False, repr=False)
    rank: None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.bootstrap_host = bootstrap_host_of(self.url)
        self.server = self
        self.port_given = self.bootstrap_port is not None

    @property
    def usable(self) -> bool:
        """May the scheduler pick this worker now? (No side effect: the scheduler refreshes
        breakers explicitly before it asks.)"""
        breaker = self.breaker
        return self.serving and (breaker.state is CLOSED or breaker.admits)

    @property
    def serving(self) -> bool:
        """Healthy, verified, not draining, not misconfigured: in rotation but for the breaker."""
        return (self.healthy and self.verified and not self.draining
                and self.misconfigured is None)

    @property
    def in_pool(self) -> bool:
        """Verified, not draining, not misconfigured and listening, whatever else its health
        checks say: what panic routing may still pick when no server of its role is `serving`
        (gateway/scheduling/scheduler.py). A server that refuses connections runs nothing: a request
        sent there would only make its prefill work for nothing."""
        return (self.verified and not self.draining and self.misconfigured is None
                and not self.refused)

    @property
    def usable_now(self) -> bool:
        """`usable` as of now, counting a breaker whose cooldown elapsed as half-open (for
        metrics and the admin API; changes nothing)."""
        breaker = self.breaker
        if breaker.state is OPEN:
            return self.serving and time.monotonic() - breaker.opened_at >= breaker.cooldown
        return self.serving and breaker.admits


    def apply_facts(self, facts: ServerFacts) -> None:
        """Adopt what the server says of itself; a port given by the operator wins."""
        if self.role == "prefill" and not self.port_given:
            self.bootstrap_port = facts.bootstrap_port
        self.model = self.model or facts.model
        self.dp_size = facts.dp_size
        self.kv_events = facts.kv_events
        self.load_balance_method = facts.load_balance_method
        self.context_length = facts.context_length
        self.max_input_length = facts.max_input_length
        self.priority_scheduling = facts.priority_scheduling
        self.low_priority_first = facts.low_priority_first
        if len(self.ranks) != (facts.dp_size if facts.dp_size > 1 else 0):
            self.ranks = [Rank(self, r) for r in range(facts.dp_size)] if facts.dp_size > 1 else []
        self.verified = True

    def ask_loads(self) -> float:
        """A `/v1/loads` poll goes out now (returns its time): the snapshots note which of
        our requests end before its answer is read (`ServerLoad.settle`)."""
        asked = time.monotonic()
        self.load.ask(asked)
        for rank in self.ranks:
            rank.load.ask(asked)
        return asked

    def apply_loads(self, data: dict, asked: float | None = None) -> bool:
        """The `/v1/loads` answer to the poll of `ask_loads` (None: now): one entry per DP
        rank, kept per rank and summed, stamped when asked (the figures are not newer).
        Whether it lists another number of ranks than the server had: it was restarted with
        another DP size, and its facts must be learned again."""
        loads = data.get("loads") if isinstance(data, dict) else None
        if not isinstance(loads, list):
            return False
        answered = time.monotonic()
        now = answered if asked is None else asked
        total = ServerLoad(updated_at=now, answered_at=answered)
        total.carry(self.load)
        usages = []
        for position, entry in enumerate(loads):
            if not isinstance(entry, dict):
                continue
            one = load_entry(entry, now)
            one.answered_at = answered
            rank = entry.get("dp_rank", position)
            ranked = isinstance(rank, int) and 0 <= rank < len(self.ranks)
            one.follow(self.ranks[rank].load if ranked else self.load)
            total.running += one.running
            total.waiting += one.waiting
            total.waiting_uncached_tokens += one.waiting_uncached_tokens
            total.used_tokens += one.used_tokens
            total.max_total_tokens += one.max_total_tokens
            total.max_running_requests += one.max_running_requests
            total.prefill_tokens += one.prefill_tokens
            total.prefill_busy_us += one.prefill_busy_us
            total.prefill_speed += one.prefill_speed  # ranks prefill side by side: a sum
            if not ranked:  # the server's own figures: its next snapshot follows the total
                total.smoothed_tokens += one.smoothed_tokens
                total.smoothed_busy_us += one.smoothed_busy_us
            usages.append(one.token_usage)
            if ranked:
                self.ranks[rank].load = one
        total.token_usage = max(usages) if usages else 0.0
        self.load = total
        return bool(usages) and len(usages) != max(1, self.dp_size)

    def totals(self) -> tuple[int, int]:
        """In-flight requests and prompt tokens over the whole gateway: this process's, or
        every worker process's with `--workers` (shared memory; the others' at most a few
        milliseconds old): `working` with the trailing legs added back."""
        requests, tokens = self.working()
        return requests + self.trailing, tokens + self.trailing_tokens

    def working(self, now: float | None = None) -> tuple[int, int]:
        """`totals` less the trailing prefill legs: the load the policies compare. Such a
        leg has computed (its decode has the KV; SGLang's prefill often answers after the
        decode), and counting it made a conversation's next turn find the server holding it
        busy with its own previous turns, and move off its cache. It stays in `totals`,
        which drains wait on, until it ends. (With `--workers`, the other processes'
        trailing legs still count: shared memory holds their legs only.) Computed here, not
        from `totals`: the policies ask it of every candidate of every pick, passing their
        `now` (time.monotonic()) for the age of the other workers' figures."""
        requests = self.in_flight - self.trailing
        tokens = self.in_flight_tokens - self.trailing_tokens
        share = self.shared
        if share is None:
            return requests, tokens
        others, other_tokens = share.others(now)
        return requests + others, tokens + other_tokens

    def trail(self, tokens: int, sign: int = 1) -> None:
        """A prefill leg here starts trailing its decode (sign 1), or ends (-1)."""
        self.trailing += sign
        self.trailing_tokens += sign * tokens

    def start(self, tokens: int) -> None:
        Counted.start(self, tokens)
        if self.shared is not None:
            self.shared.publish(self.in_flight, self.in_flight_tokens)
        if self.breaker.state is not CLOSED:
            self.breaker.on_dispatch()

    def finish(self, tokens: int, success: bool | None) -> bool:
        """Release counters; success None means the outcome says nothing about the server.
        Returns True when this failure opened the breaker."""
        Counted.finish(self, tokens)
        if self.shared is not None:
            self.shared.publish(self.in_flight, self.in_flight_tokens)
        if success is None:
            self.breaker.release_probe()
            return False
        if success:
            self.last_success = time.monotonic()
            self.suspect_until = 0.0
        else:
            self.total_failures += 1
        return self.breaker.record(success)

    def snapshot(self) -> dict:
        return {
            "url": self.url,
            "role": self.role,
            "bootstrap_port": self.bootstrap_port,
            "model": self.model,
            "healthy": self.healthy,
            "verified": self.verified,
            "misconfigured": self.misconfigured,
            "refused": self.refused,
            "draining": self.draining,
            "breaker": self.breaker.state.value,
            "suspect": self.suspect_until > time.monotonic(),
            "usable": self.usable_now,
            "in_flight": self.totals()[0],
            "in_flight_tokens": self.totals()[1],
            "total_requests": self.total_requests,
            "total_failures": self.total_failures,
            "load": {
                "running": self.load.running,
                "waiting": self.load.waiting,
                "waiting_uncached_tokens": self.load.waiting_uncached_tokens,
                "token_usage": self.load.token_usage,
                # tokens/s from SGLang's prefill busy counters (0: not measured yet): what
                # the SLO model's forecasts divide a prompt by
                "prefill_speed": round(self.load.prefill_speed, 1),
            },
            "dp_ranks": self.dp_size,
            "load_balance_method": self.load_balance_method,
            "ranks": [{"rank": r.rank, "in_flight": r.in_flight, "requests": r.total_requests,
                       "running": r.load.running, "waiting": r.load.waiting}
                      for r in self.ranks],
        }


class ServerPool:
    """All known workers by URL; listeners hear about membership changes."""

    def __init__(self) -> None:
        self._servers: dict[str, Server] = {}
        self._by_role: dict[str, list[Server]] = {role: [] for role in ROLES}
        self._listeners: list[Callable[[], None]] = []

    def add(self, server: Server) -> Server:
        if server.role not in ROLES:
            raise ValueError(f"unknown role {server.role!r}")
        if server.url in self._servers:
            raise ValueError(f"{server.url} is already registered")
        self._servers[server.url] = server
        self._by_role[server.role].append(server)
        self.notify()
        return server

    def remove(self, url: str) -> Server | None:
        server = self._servers.pop(url, None)
        if server is not None:
            self._by_role[server.role].remove(server)
            self.notify()
        return server

    def get(self, url: str) -> Server | None:
        return self._servers.get(url)

    def role(self, role: str) -> list[Server]:
        return self._by_role[role]

    def usable(self, role: str) -> list[Server]:
        return [w for w in self._by_role[role] if w.usable]

    def __iter__(self) -> Iterable[Server]:
        return iter(list(self._servers.values()))

    def __len__(self) -> int:
        return len(self._servers)

    def on_change(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def notify(self) -> None:
        """Tell listeners the workers changed (membership, or facts learned by a probe)."""
        for listener in self._listeners:
            listener()


def breaker_state_code(state: BreakerState) -> int:
    """Numeric breaker state for gauges: 0 closed, 1 half-open, 2 open."""
    return {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}[state]
