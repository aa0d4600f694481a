"""Automatic rebalancing: move a server to the role that is pressed, through the by-hand
switch's own procedure (role_switch.py), when the pressures (pressure.py) say so.

Every interval (the `/v1/loads` poll's) the loop measures each model's pressures, publishes
what each role needs (`gateway_desired_servers`, with rebalancing off too), and, with
`--rebalance`, asks for one switch when all of these hold:

* one role was pressed at HIGH or more at every reading of the last window (a burst shorter
  than the window moves nothing);
* the other role would stand at TARGET or below with one server fewer, and keeps at least
  the minimum (never below 1): HIGH > TARGET is the hysteresis, since the role that gave a
  server up cannot then read HIGH without the load itself changing;
* the cool-down since the last attempt ended is over (a drain lasts as long as the requests
  in flight on its server: counted from the start, the cool-down could be spent before the
  server served in its new role), and fewer than the hourly budget of attempts were started
  in the last hour (refused attempts count: a server that keeps saying no is not asked
  again and again).

One more case is not a pressure: every prefill of a model down (none of them `serving`:
health checks failed, refusing connections, taken out; not drained by an operator) serves
nothing, and reads as an idle
role. When that has lasted a whole window and at least two decodes serve (so the decodes
keep the minimum, never below 1), one decode is switched to prefill, reason `prefill_down`,
within the same cool-down and hourly budget (`without_prefill`). A model with no prefill at
all configured is not this case. Down, not slow: a request success counts as a good health
check (health/checker.py), so a slow prefill stays serving; and a window (10 s by default)
is longer than a health check needs to mark one down, shorter than an SGLang restart.
In that outage the switch's answer is bounded by `answer_within` (10 s, not the switch's
300 s): a decode that does not answer is taken out (role_switch.py) and the next-cheapest
tried at once, up to OUTAGE_TRIES in a row, each counted in the hourly budget, never
below the minimum (before: 37.7 s of 503s behind one hung decode with a 30 s bound).

The server moved is the one cheapest to drain: fewest requests of ours in flight, then the
least KV in use (the cache it would lose; SGLang drops its radix cache on a flip). Each
attempt is one log line with the pressures that caused it and one count of
`gateway_rebalance_decisions_total{from,to,reason,outcome}`.

With `--workers`, worker 0 alone decides (its `/v1/loads` figures are its own polls and its
metrics read every worker's streams); the switch lock (switch_lock.py) still serializes it
with the admin API's switches of any worker. Replicas do not coordinate: turn it on in one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.errors import GatewayError
from gateway.servers.pool import Server, ServerPool
from gateway.servers.pressure import TARGET, Pressure, PressureGauge
from gateway.servers.role_switch import RoleSwitcher, SwitchAsk, SwitchUnanswered

log = logging.getLogger("gateway.rebalance")

HIGH = 1.0  # a role pressed this hard for a whole window asks for a server
HOUR = 3600.0
ITL_METRIC = "gateway_inter_token_latency_seconds"
OUTAGE = "prefill_down"  # the move's reason when every prefill of a model is down
OUTAGE_TRIES = 3  # decodes one outage's attempt tries in a row, each unanswered one taken out


@dataclass(frozen=True, slots=True)
class RebalanceOptions:
    """The `--rebalance*` settings, in seconds."""

    enabled: bool = False
    ttft_s: float = 1.5
    itl_s: float = 0.06
    window: float = 10.0
    cooldown: float = 60.0
    per_hour: int = 6
    minimum: int = 1
    interval: float = 2.0
    deadline: float = 60.0  # the drain deadline of each switch (not its answer: 300 s)
    # in an outage, the bound of the switch's answer: to prefill SGLang rebuilds small
    # structures (no KV reallocation, no graph capture): 0.43 s with the drain on the CPU rig
    answer_within: float = 10.0

    @classmethod
    def from_config(cls, c) -> RebalanceOptions:
        return cls(c.rebalance, c.rebalance_ttft_ms / 1e3, c.rebalance_itl_ms / 1e3,
                   c.rebalance_window, c.rebalance_cooldown, c.rebalance_max_per_hour,
                   c.rebalance_min_servers, max(0.5, c.loads_interval or 2.0))


@dataclass(frozen=True, slots=True)
class Move:
    """One role gives a server to the other, and why (the pressed role's signal)."""

    old: str
    new: str
    reason: str


def decide(history: list[Pressure], window: float, minimum: int) -> Move | None:
    """The move the readings of the last `window` seconds call for, or None (pure)."""
    if not history or history[-1].at - history[0].at < window:
        return None  # not a whole window of readings yet
    last = history[-1]
    for needy, giver in (("prefill", "decode"), ("decode", "prefill")):
        if last.of(giver).servers <= max(1, minimum):
            continue
        if all(p.of(needy).value >= HIGH and p.of(giver).without_one() <= TARGET
               for p in history):
            return Move(giver, needy, f"{needy}_{last.of(needy).signal}")
    return None


def without_prefill(servers: list[Server], since: float | None, now: float, window: float,
                    minimum: int) -> Move | None:
    """A decode to prefill when every prefill has been down (`since`) for a whole `window`
    and the decodes that serve can spare one, keeping `minimum` (never below 1) (pure)."""
    if since is None or now - since < window:
        return None
    decodes = sum(1 for s in servers if s.role == "decode" and s.serving)
    if decodes <= max(1, minimum):
        return None
    return Move("decode", "prefill", OUTAGE)


def all_down(prefills: list[Server]) -> bool:
    """Prefills known and none serving; one an operator drains, healthy, is not down: taken
    out of traffic on purpose, it is not for a decode to stand in for."""
    return bool(prefills) and not any(
        s.serving or (s.draining and s.healthy and s.misconfigured is None) for s in prefills)


def cheapest(servers: list[Server]) -> Server:
    """The server whose drain costs least: fewest of ours in flight, least KV in use."""
    return min(servers, key=lambda s: (s.totals()[0] + len(s.attempts), s.load.used_tokens,
                                       s.url))


class Rebalancer:
    """The loop; one per worker process (only the deciding one switches)."""

    def __init__(self, pool: ServerPool, switcher: RoleSwitcher, options: RebalanceOptions,
                 read_itl: Callable[[], tuple[float, float]], counted: Any,
                 decides: bool = True, clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        self.clock = clock
        self.switcher = switcher
        self.options = options
        self.read_itl = read_itl
        self.counted = counted  # gateway_rebalance_decisions (from, to, reason, outcome)
        self.decides = decides and options.enabled
        self.gauges: dict[str | None, PressureGauge] = {}
        self.history: dict[str | None, deque[Pressure]] = {}
        self.desired: dict[tuple[str, str], int] = {}  # (model, role) -> servers needed
        self.pressures: dict[tuple[str, str], float] = {}
        self.attempts: deque[float] = deque()  # monotonic times of the last hour's attempts
        self.ended: float | None = None  # when the last attempt ended: the cool-down's start
        self.stranded: dict[str | None, float] = {}  # model -> since when no prefill serves
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.options.interval)
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not stop the loop, nor the gateway
                log.exception("rebalance step failed")

    async def step(self, now: float | None = None) -> Move | None:
        """One reading of every model; at most one switch (in an outage, one more for each
        decode that did not answer). The move made, if any. `now`: a simulated instant
        (tests), on which a switch takes no time; else `clock`."""
        timed = now is None
        now = self.clock() if now is None else now
        itl = self.read_itl()
        by_model: dict[str | None, list[Server]] = {}
        for server in self.pool:
            by_model.setdefault(server.model, []).append(server)
        chosen: tuple[str | None, Move] | None = None
        for model, servers in by_model.items():
            move = self._read(model, servers, itl, now)
            if move is not None and chosen is None:
                chosen = (model, move)
        for model in [m for m in self.history if m not in by_model]:
            del self.history[model], self.gauges[model]
            self.stranded.pop(model, None)
        if chosen is None or not self._may_switch(now):
            return None
        model, move = chosen
        await self._switch(model, move, now, timed)
        return move

    def _read(self, model: str | None, servers: list[Server], itl: tuple[float, float],
              now: float) -> Move | None:
        o = self.options
        gauge = self.gauges.get(model)
        if gauge is None:
            gauge = self.gauges[model] = PressureGauge(o.ttft_s, o.itl_s)
        pressure = gauge.measure(servers, itl, now)
        label = model or "default"
        for role in ("prefill", "decode"):
            self.desired[(label, role)] = pressure.of(role).needed(o.minimum)
            self.pressures[(label, role)] = round(pressure.of(role).value, 4)
        history = self.history.setdefault(model, deque())
        history.append(pressure)
        while len(history) > 1 and now - history[1].at >= o.window:
            history.popleft()  # keep just one reading at or before the window's start
        if not self.decides:
            return None
        since = self._stranded(model, servers, now)  # at every reading, whatever is decided
        return decide(list(history), o.window, o.minimum) or \
            without_prefill(servers, since, now, o.window, o.minimum)

    def _stranded(self, model: str | None, servers: list[Server], now: float) -> float | None:
        """Since when the model's prefills have all been down (`all_down`; None while one
        serves, or none is known)."""
        if not all_down([s for s in servers if s.role == "prefill"]):
            self.stranded.pop(model, None)
            return None
        return self.stranded.setdefault(model, now)

    def _budget_left(self, now: float) -> bool:
        while self.attempts and now - self.attempts[0] >= HOUR:
            self.attempts.popleft()
        return len(self.attempts) < self.options.per_hour

    def _may_switch(self, now: float) -> bool:
        return self._budget_left(now) and (
            self.ended is None or now - self.ended >= self.options.cooldown)

    async def _switch(self, model: str | None, move: Move, now: float, timed: bool) -> None:
        """One attempt; its end starts the cool-down (`timed`: read the clock then, else
        the simulated `now`). In an outage a decode that did not answer its switch is out,
        and the role still empty: the next-cheapest is tried at once, no cool-down between,
        while the prefills stay down and the hourly budget and the minimum allow."""
        why = self.history[model][-1].describe()
        for _ in range(OUTAGE_TRIES if move.reason == OUTAGE else 1):
            if not await self._attempt(model, move, now, timed, why):
                return
            now = self.clock() if timed else now
            prefills = [s for s in self.pool.role("prefill") if s.model == model]
            if not all_down(prefills) or not self._budget_left(now):
                return
            why = "the last one tried did not answer its switch"

    async def _attempt(self, model: str | None, move: Move, now: float, timed: bool,
                       why: str) -> bool:
        """One switch of the cheapest giver; True when it went unanswered (taken out)."""
        givers = [s for s in self.pool.role(move.old) if s.model == model and s.serving]
        if len(givers) <= max(1, self.options.minimum):
            return False
        server = cheapest(givers)
        self.attempts.append(now)
        self.history[model].clear()  # a new window after any attempt: the fleet changed
        log.warning("rebalance: switching %s from %s to %s (%s for %gs: %s)", server.url,
                    move.old, move.new, move.reason, self.options.window, why)
        within = self.options.answer_within if move.reason == OUTAGE else None
        ask = SwitchAsk(server.url, move.new, self.options.deadline, answer_within=within)
        unanswered = False
        try:
            body = await self.switcher.switch(ask)
        except GatewayError as err:
            outcome = (err.code or "error").removeprefix("role_switch_")
            unanswered = isinstance(err, SwitchUnanswered)
            log.warning("rebalance: %s stays %s: %s", server.url, move.old, err.detail)
        else:
            outcome = "switched"
            log.warning("rebalance: %s is now a %s server (drained and switched in %.3fs)",
                        server.url, move.new, body["waited_s"])
        finally:  # a drain may take most of a cool-down counted from the start
            self.ended = self.clock() if timed else now
        self.counted.labels(move.old, move.new, move.reason, outcome).inc()
        return unanswered

    def figures(self) -> dict[str, dict[tuple[str, str], float]]:
        """What `gateway_desired_servers` and `gateway_role_pressure` show."""
        return {"desired": dict(self.desired), "pressure": dict(self.pressures)}


def itl_totals(families: list) -> tuple[float, float]:
    """The cumulative (sum, count) of streamed inter-token gaps, all endpoints."""
    total = count = 0.0
    for family in families:
        if family.name != ITL_METRIC:
            continue
        for sample in family.samples:
            if sample.name == ITL_METRIC + "_sum":
                total += sample.value
            elif sample.name == ITL_METRIC + "_count":
                count += sample.value
    return total, count


def for_gateway(gw, switcher: RoleSwitcher) -> Rebalancer:
    """The gateway's rebalancer, its figures on /metrics; worker 0 decides with --workers.
    Kubernetes discovery refuses switches (docs/ROLE_SWITCH.md): there it only advises."""
    options = RebalanceOptions.from_config(gw.config)
    deciding = gw.worker is None or gw.worker.id == 0
    if options.enabled and switcher.parts.refuse_all is not None:
        log.warning("--rebalance: no automatic switches here (%s); "
                    "gateway_desired_servers is still published", switcher.parts.refuse_all)
        deciding = False
    if options.enabled and not gw.config.loads_interval:
        log.warning("--rebalance with --loads-interval 0: no load figures to read, so no "
                    "role is ever pressed and nothing switches")
    rebalancer = Rebalancer(gw.pool, switcher, options, lambda: itl_totals(gw.read_metrics()),
                            gw.metrics.rebalance_decisions, decides=deciding)
    gw.metrics.watch_rebalance(rebalancer.figures)
    return rebalancer
