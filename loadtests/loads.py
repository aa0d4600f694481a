"""Three load shapes: closed loop, open loop on a fixed schedule, and concurrent long streams.

Each takes a route (`loadtests.routes`) and a meter with `start()` / `stop() -> CPU seconds`,
called at the edges of the measured window, so CPU and request counts cover the same interval.
The open loop sends on a schedule computed in advance and measures each latency from the
request's scheduled send time, not from when it went out: a stalled target cannot slow the
sender down and hide its own queueing (no coordinated omission).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any

from loadtests.client import ReplyError

DRAIN_TIMEOUT = 30.0  # seconds to wait for in-flight requests once a window has closed


class NullMeter:
    def start(self) -> None:
        pass

    def stop(self) -> None:
        return None


@dataclass
class Closed:
    requests: int
    errors: int
    seconds: float
    cpu: Any  # what the meter's stop() returned

    @property
    def rps(self) -> float:
        return self.requests / self.seconds


@dataclass
class Opened:
    rate: float
    sent: int
    errors: int
    p50_ms: float
    p99_ms: float
    max_ms: float


@dataclass
class Streamed:
    streams: int
    events: int
    errors: int
    seconds: float
    cpu: Any  # what the meter's stop() returned
    first_event_ms: list[float] = field(default_factory=list)  # per stream, sorted

    @property
    def events_per_s(self) -> float:
        return self.events / self.seconds

    @property
    def first_event_p50_ms(self) -> float | None:
        """Median time from a stream's request to its first event (a stream's TTFT)."""
        return _percentile(self.first_event_ms, 0.5) if self.first_event_ms else None


async def _finish(tasks: list[asyncio.Task]) -> None:
    done, pending = await asyncio.wait(tasks, timeout=DRAIN_TIMEOUT)
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending)


async def closed_loop(route, concurrency: int, warmup: float, duration: float,
                      meter=None, latencies: list[float] | None = None) -> Closed:
    """`concurrency` workers, each sending its next request as soon as the last one answered.

    With `latencies`, the seconds each request counted in the window took are appended."""
    meter = meter or NullMeter()
    sessions = [route.session() for _ in range(concurrency)]
    state = {"counting": False, "stop": False, "done": 0, "errors": 0}
    clock = time.perf_counter

    async def worker(session) -> None:
        while not state["stop"]:
            sent = clock()
            try:
                await session.call()
            except ReplyError:
                if state["counting"]:
                    state["errors"] += 1
                await asyncio.sleep(0.01)
                continue
            if state["counting"]:
                state["done"] += 1
                if latencies is not None:
                    latencies.append(clock() - sent)

    tasks = [asyncio.create_task(worker(s)) for s in sessions]
    try:
        await asyncio.sleep(warmup)
        meter.start()
        state["counting"], t0 = True, time.perf_counter()
        await asyncio.sleep(duration)
        state["counting"], seconds = False, time.perf_counter() - t0
        cpu = meter.stop()
        state["stop"] = True
        await _finish(tasks)
    finally:
        for s in sessions:
            s.close()
    return Closed(state["done"], state["errors"], seconds, cpu)


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return math.inf
    index = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[index]


async def open_loop(route, rate: float, duration: float, max_sessions: int = 512) -> Opened:
    """Send `rate` requests per second for `duration` seconds on a precomputed schedule.

    Failed and unfinished requests count as infinite latency, so an overloaded target shows
    an infinite p99 rather than a flattering one.
    """
    count = max(1, int(rate * duration))
    idle: asyncio.Queue = asyncio.Queue()
    opened = 0
    latencies = [math.inf] * count
    errors = 0

    # Warm connections, so the first scheduled requests do not pay for the TCP handshake.
    warm = [route.session() for _ in range(min(64, max_sessions))]
    await asyncio.gather(*(s.call() for s in warm), return_exceptions=True)
    for s in warm:
        idle.put_nowait(s)
    opened = len(warm)
    all_sessions = list(warm)

    async def one(i: int, scheduled: float) -> None:
        nonlocal opened, errors
        if idle.empty() and opened < max_sessions:
            opened += 1
            session = route.session()
            all_sessions.append(session)
        else:
            session = await idle.get()
        try:
            await session.call()
            latencies[i] = time.perf_counter() - scheduled
        except ReplyError:
            errors += 1
        finally:
            idle.put_nowait(session)

    tasks = []
    start = time.perf_counter() + 0.05
    try:
        for i in range(count):
            scheduled = start + i / rate
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, scheduled)))
        await _finish(tasks)
    finally:
        for s in all_sessions:
            s.close()
    ordered = sorted(latencies)
    return Opened(rate, count, errors, _percentile(ordered, 0.50) * 1e3,
                  _percentile(ordered, 0.99) * 1e3, ordered[-1] * 1e3)


async def streams(route, concurrency: int, duration: float, meter=None) -> Streamed:
    """`concurrency` workers, each running long streams back to back until `duration` passed.

    The last stream of each worker runs to its end; the window closes when all have ended,
    so every counted event belongs to a complete stream.
    """
    meter = meter or NullMeter()
    sessions = [route.session() for _ in range(concurrency)]
    totals = {"streams": 0, "events": 0, "errors": 0}
    firsts: list[float] = []
    deadline = 0.0

    async def worker(session) -> None:
        while time.perf_counter() < deadline:
            try:
                events = await session.call()
            except ReplyError:
                totals["errors"] += 1
                await asyncio.sleep(0.01)
                continue
            totals["streams"] += 1
            totals["events"] += events
            if session.first_event is not None:  # seconds to its first event
                firsts.append(session.first_event * 1000)

    try:
        # One stream per session first: connections open, caches warm, outside the window.
        await asyncio.gather(*(s.call() for s in sessions), return_exceptions=True)
        meter.start()
        t0 = time.perf_counter()
        deadline = t0 + duration
        await _finish([asyncio.create_task(worker(s)) for s in sessions])
        seconds = time.perf_counter() - t0
        cpu = meter.stop()
    finally:
        for s in sessions:
            s.close()
    return Streamed(totals["streams"], totals["events"], totals["errors"], seconds, cpu,
                    sorted(firsts))
