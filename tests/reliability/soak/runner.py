"""Run one soak: a real gateway (default flags) over 2 prefill + 3 decode sims, a seeded
fault schedule played by a thread, and paced mixed traffic whose every answer is checked.

After the traffic, every fault is cleared and the leftovers are checked: the gateway's
in-flight gauges back to 0, no bootstrap room reused (the sims count it), no client
connection left open and the gateway's connections to servers within a bound.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.reliability.soak.report import Outcome, SoakResult
from tests.reliability.soak.schedule import Action, Schedule, clear_knobs, make_schedule
from tests.reliability.soak.traffic import Request, check, make_request
from tests.rigs.faults import Rig, Server, running_rig, wait_until

LATENCY_BOUND = 30.0  # an answer slower than this fails the invariant
HARD_CAP = 45.0  # the client gives up on a request after this long
SETTLE = 30.0  # after the traffic: how long the gateway has to drop its in-flight counts
N_PREFILL, N_DECODE = 2, 3


@dataclass(frozen=True)
class SoakOptions:
    seconds: float = 40.0
    rate: float = 12.0  # requests started per second (fewer while `concurrency` are open)
    concurrency: int = 8
    gateway_args: Sequence[str] = ()  # empty: the gateway's defaults, as a user runs it
    faults: bool = True  # False: the same traffic with no fault (the harness's control run)


def names() -> tuple[list[str], list[str]]:
    """The rig's server names (tests/rigs/faults.py names them role + index)."""
    return [f"prefill{i}" for i in range(N_PREFILL)], [f"decode{i}" for i in range(N_DECODE)]


def schedule_for(seed: int, seconds: float) -> Schedule:
    prefills, decodes = names()
    return make_schedule(seed, seconds, prefills, decodes)


def run_soak(seed: int, log_dir: Path, options: SoakOptions = SoakOptions()) -> SoakResult:
    """One seed, start to finish, in a fresh rig; never raises for an invariant broken."""
    schedule = schedule_for(seed, options.seconds)
    if not options.faults:
        schedule = Schedule(seed, options.seconds, (), ())
    result = SoakResult(seed, options.seconds, schedule)
    with running_rig(log_dir, options.gateway_args, N_PREFILL, N_DECODE) as rig:
        result.servers = {s.name: s.url for s in rig.servers} | {"gateway": rig.gateway}
        result.measured["tasks_at_rest"] = _tasks(rig)  # before any traffic
        t0 = time.monotonic()
        executor = FaultExecutor(rig, schedule, t0)
        executor.start()
        try:
            outcomes = asyncio.run(drive(rig.gateway, seed, options, t0))
        finally:
            executor.finish()
        result.outcomes.extend(outcomes)
        result.executor_errors.extend(executor.errors)
        result.after.extend(leftovers(rig, options.concurrency, result.measured))
        result.sim_faults = applied_faults(rig)
    return result


class FaultExecutor(threading.Thread):
    """Plays the schedule's actions at their times; `finish` undoes whatever is still on."""

    def __init__(self, rig: Rig, schedule: Schedule, t0: float) -> None:
        super().__init__(name="soak-faults", daemon=True)
        self.rig, self.schedule, self.t0 = rig, schedule, t0
        self.servers: dict[str, Server] = {s.name: s for s in rig.servers}
        self.stopping = threading.Event()
        self.frozen: set[str] = set()
        self.dead: set[str] = set()
        self.restarts: list[threading.Thread] = []
        self.errors: list[str] = []

    def run(self) -> None:
        for action in self.schedule.actions:
            delay = self.t0 + action.at - time.monotonic()
            if delay > 0 and self.stopping.wait(delay):
                return
            try:
                self._do(action)
            except Exception as exc:  # noqa: BLE001 - reported, the soak goes on
                self.errors.append(f"{action.op} {action.server} at {action.at}s: {exc!r}")

    def _do(self, action: Action) -> None:
        server = self.servers[action.server]
        if action.op == "knobs":
            self.rig.fault(server, **dict(action.knobs))
        elif action.op == "freeze":
            self.rig.freeze(server)
            self.frozen.add(server.name)
        elif action.op == "thaw":
            self.rig.thaw(server)
            self.frozen.discard(server.name)
        elif action.op == "kill":
            self.rig.kill(server)
            self.dead.add(server.name)
        elif action.op == "restart":
            thread = threading.Thread(target=self._restart, args=(server,), daemon=True)
            self.restarts.append(thread)
            thread.start()

    def _restart(self, server: Server) -> None:
        try:
            self.rig.restart(server)
            self.dead.discard(server.name)
        except Exception as exc:  # noqa: BLE001
            self.errors.append(f"restart {server.name}: {exc!r}")

    def finish(self) -> None:
        """Stop playing; thaw, restart and clear every server so the leftovers can be read."""
        self.stopping.set()
        self.join()
        for thread in self.restarts:
            thread.join()
        for name in list(self.frozen):
            self.rig.thaw(self.servers[name])
        for name in list(self.dead):
            self._restart(self.servers[name])
        for server in self.rig.servers:
            try:
                self.rig.fault(server, **clear_knobs())
            except httpx.HTTPError as exc:
                self.errors.append(f"clear {server.name}: {exc!r}")


async def drive(gateway: str, seed: int, options: SoakOptions, t0: float) -> list[Outcome]:
    """Start requests at `rate` (at most `concurrency` open) until `seconds` have passed."""
    rng = random.Random(f"traffic-{seed}")  # apart from the schedule's stream
    limits = httpx.Limits(max_connections=options.concurrency,
                          max_keepalive_connections=options.concurrency)
    timeout = httpx.Timeout(HARD_CAP, connect=5.0)
    slots = asyncio.Semaphore(options.concurrency)
    tasks: list[asyncio.Task[Outcome]] = []
    async with httpx.AsyncClient(base_url=gateway, timeout=timeout, limits=limits) as client:
        next_at = 0.0
        while True:
            now = time.monotonic() - t0
            if next_at > now:
                await asyncio.sleep(next_at - now)
            await slots.acquire()
            if time.monotonic() - t0 >= options.seconds:
                slots.release()
                break
            request = make_request(rng, len(tasks))
            tasks.append(asyncio.create_task(_one(client, request, slots, t0)))
            next_at = max(next_at + 1.0 / options.rate, time.monotonic() - t0)
        return list(await asyncio.gather(*tasks))


async def _one(client: httpx.AsyncClient, request: Request, slots: asyncio.Semaphore,
               t0: float) -> Outcome:
    started = time.monotonic()
    status, chunks, failure = 0, [], None
    try:
        async with asyncio.timeout(HARD_CAP):
            async with client.stream("POST", request.path, json=request.body) as response:
                status = response.status_code
                async for chunk in response.aiter_bytes():
                    chunks.append(chunk)
    except TimeoutError:
        failure = ("timeout", f"no complete answer in {HARD_CAP:g}s (status {status}); got "
                              f"{b''.join(chunks)[-200:]!r}")
    except httpx.HTTPError as exc:
        failure = ("transport", f"{type(exc).__name__}: {exc} after {len(b''.join(chunks))} "
                                f"bytes (status {status})")
    finally:
        slots.release()
    latency = time.monotonic() - started
    if failure is None:
        failure = check(request, status, b"".join(chunks))
    if failure is None and latency > LATENCY_BOUND:
        failure = ("slow", f"{latency:.1f}s > {LATENCY_BOUND:g}s")
    return Outcome(request.kind, started - t0, latency, status, failure)


TASK_SLACK = 2  # tasks that may come and go at rest (a probe or a scrape in progress)


def leftovers(rig: Rig, concurrency: int, measured: dict[str, object]) -> list[tuple[str, str]]:
    """What the run left behind, once every fault is cleared: (failure kind, detail); the
    figures read go into `measured`."""
    found = []
    try:
        wait_until(lambda: _in_flight(rig) == (0, 0), SETTLE, "in-flight counts back to 0",
                   interval=0.5, detail=lambda: _in_flight(rig))
    except AssertionError as exc:
        found.append(("leak_in_flight", f"(server, admission) in flight: {exc}"))
    rest = int(measured.get("tasks_at_rest", 0))
    try:
        wait_until(lambda: _tasks(rig) <= rest + TASK_SLACK, SETTLE,
                   "the gateway's asyncio tasks back to their count at rest", interval=0.5)
    except AssertionError as exc:
        found.append(("leak_tasks", f"{_tasks(rig)} asyncio tasks, {rest} at rest: {exc}"))
    measured["tasks_after"] = _tasks(rig)
    reused = {s.name: n for s in rig.servers if (n := rig.stats(s)["rooms_reused"])}
    if reused:
        found.append(("room_reused", f"rooms offered twice, by sim: {reused}"))
    rig.hang_up()
    try:
        wait_until(lambda: _connections(rig)[0] == 0, 10.0, "client connections closed",
                   interval=0.5)
    except AssertionError as exc:
        found.append(("leak_connections", f"client connections still open: {exc}"))
    upstream = _connections(rig)[1]
    bound = connection_bound(concurrency)
    measured.update({"in_flight": _in_flight(rig), "rooms_reused": sum(reused.values()),
                     "server_connections": upstream, "connection_bound": bound})
    if upstream > bound:
        found.append(("leak_connections", f"{upstream} connections to servers > {bound}: "
                                          f"{dict(rig.connections())}"))
    return found


def connection_bound(concurrency: int) -> int:
    """Server connections the gateway may keep after a run: a keep-alive one per leg of each
    request that could be open at once (2 legs, n=2 samples), plus one per server for
    health and load probes."""
    return concurrency * 2 * 2 + 2 * (N_PREFILL + N_DECODE)


def _tasks(rig: Rig) -> int:
    """The gateway's asyncio tasks now (`gateway_event_loop_tasks`)."""
    return int(rig.metrics().total("gateway_event_loop_tasks"))


def _in_flight(rig: Rig) -> tuple[float, float]:
    metrics = rig.metrics()
    return (metrics.total("gateway_server_in_flight_requests"),
            metrics.total("gateway_admission_active"))


def _connections(rig: Rig) -> tuple[int, int]:
    """(connections clients hold open to the gateway, the gateway's to servers)."""
    tally = rig.connections()
    clients = sum(n for (peer, state), n in tally.items()
                  if peer == "client" and state == "ESTABLISHED")
    upstream = sum(n for (peer, _), n in tally.items() if peer not in ("client", "other"))
    return clients, upstream


def applied_faults(rig: Rig) -> dict[str, int]:
    """Answers the sims broke on purpose, by kind (a restarted sim counts from its restart)."""
    total: dict[str, int] = {}
    for server in rig.servers:
        for kind, count in rig.stats(server)["faults_applied"].items():
            total[kind] = total.get(kind, 0) + count
    return total
