"""Load from several processes: K load generators, each its own uvloop loop on its own cores.

One load-generator process (the loops of loadtests/loads.py over loadtests/client.py
connections, about 25 us of CPU per request) cannot keep a proxy on 8 cores busy, so
`loadtests.scaling` runs K of them. They are spawned once, each pinned to its CPUs, and given
one phase at a time. Every process begins a phase at the same instant of the monotonic clock
(one clock for all processes of a machine), so their warm-ups and measured windows coincide;
process 0 also reads the CPU meter (procstat.WindowMeter over /proc: the proxy, the servers
and every load process) at its window's edges, so CPU and request counts cover one interval.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import os
import signal
import time
from array import array
from dataclasses import dataclass
from multiprocessing.connection import Connection

from loadtests import loads
from loadtests.procstat import Usage, WindowMeter
from loadtests.routes import ViaProxy

START_DELAY = 0.3  # seconds from sending a phase to its start: every process has it by then
SPAWN_TIMEOUT = 60.0
REPLY_MARGIN = loads.DRAIN_TIMEOUT + 30.0  # beyond a phase's own length


class LoadGenBroken(Exception):
    """A load process did not answer in time: its pipe is out of step, the run must stop."""


@dataclass(frozen=True)
class Phase:
    """What every load process runs once, against one proxy."""

    kind: str  # "closed": small requests back to back; "streams": long SSE streams
    port: int
    path: str
    body: dict
    connections: int  # per process
    warmup: float  # closed loop only (streams warm up with one stream per connection)
    duration: float
    start_at: float = 0.0  # time.monotonic() at which every process begins
    meter: tuple[int | None, list[int], list[int]] | None = None  # proxy, servers, load pids


@dataclass(frozen=True)
class Share:
    """One process's part of a phase."""

    done: int  # requests (closed) or streams completed in the window
    errors: int
    seconds: float
    events: int = 0
    latencies: bytes = b""  # array("d") of seconds per request (closed loop)
    usage: Usage | None = None  # process 0 only
    failure: str | None = None  # the exception that stopped the process's phase


@dataclass(frozen=True)
class Total:
    """A phase summed over the processes."""

    done: int
    errors: int
    events: int
    rate: float  # requests/s (closed) or events/s (streams): the sum of the processes' rates
    latencies: list[float]
    usage: Usage | None  # process 0's window
    seconds: float  # process 0's window


async def _run(phase: Phase) -> Share:
    delay = phase.start_at - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
    route = ViaProxy(phase.port, phase.path, phase.body)
    meter = WindowMeter(*phase.meter) if phase.meter else None
    if phase.kind == "closed":
        latencies: list[float] = []
        closed = await loads.closed_loop(route, phase.connections, phase.warmup,
                                         phase.duration, meter, latencies)
        return Share(closed.requests, closed.errors, closed.seconds,
                     latencies=array("d", latencies).tobytes(), usage=closed.cpu)
    streamed = await loads.streams(route, phase.connections, phase.duration, meter)
    return Share(streamed.streams, streamed.errors, streamed.seconds, events=streamed.events,
                 usage=streamed.cpu)


def _serve(pipe: Connection, cpus: set[int] | None) -> None:
    """A load process: phases in, shares out, until the pipe closes or says None."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops us
    if cpus:
        os.sched_setaffinity(0, cpus)
    try:
        import uvloop
        factory = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        pipe.send("ready")
        while True:
            try:
                phase = pipe.recv()
            except EOFError:
                return
            if phase is None:
                return
            try:
                share = runner.run(_run(phase))
            except Exception as exc:  # reported to the parent, which stops the run
                share = Share(0, 0, 0.0, failure=f"{type(exc).__name__}: {exc}")
            pipe.send(share)


class LoadGen:
    """K load processes, one per entry of `cpus` (None: not pinned); `close()` stops them."""

    def __init__(self, cpus: list[set[int] | None]) -> None:
        ctx = multiprocessing.get_context("spawn")  # a clean interpreter, no inherited loop
        self.pipes: list[Connection] = []
        self.procs = []
        try:
            for i, cpu in enumerate(cpus):
                ours, theirs = ctx.Pipe()
                proc = ctx.Process(target=_serve, args=(theirs, cpu), name=f"loadgen{i}",
                                   daemon=True)
                proc.start()
                theirs.close()
                self.pipes.append(ours)
                self.procs.append(proc)
            for pipe in self.pipes:
                self._recv(pipe, SPAWN_TIMEOUT)
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs]

    @staticmethod
    def _recv(pipe: Connection, timeout: float):
        try:
            if pipe.poll(timeout):
                return pipe.recv()
        except (EOFError, OSError) as exc:
            raise LoadGenBroken(f"a load process died: {exc!r}") from exc
        raise LoadGenBroken(f"a load process did not answer within {timeout:.0f}s")

    def run(self, phase: Phase, proxy_pid: int | None, server_pids: list[int]) -> Total:
        """Run `phase` in every process at once; the sum of what they counted."""
        start_at = time.monotonic() + START_DELAY
        for i, pipe in enumerate(self.pipes):
            meter = (proxy_pid, server_pids, self.pids) if i == 0 else None
            pipe.send(dataclasses.replace(phase, start_at=start_at, meter=meter))
        limit = START_DELAY + phase.warmup + phase.duration + REPLY_MARGIN
        shares: list[Share] = [self._recv(pipe, limit) for pipe in self.pipes]
        failed = [s.failure for s in shares if s.failure]
        if failed:
            raise RuntimeError(f"load process failed: {failed[0]}")
        latencies: list[float] = []
        for share in shares:
            latencies.extend(array("d", share.latencies))
        per_second = [(s.done if phase.kind == "closed" else s.events) / s.seconds
                      for s in shares if s.seconds > 0]
        return Total(sum(s.done for s in shares), sum(s.errors for s in shares),
                     sum(s.events for s in shares), sum(per_second), latencies,
                     shares[0].usage, shares[0].seconds)

    def close(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(5)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
        for pipe in self.pipes:
            pipe.close()

    def __enter__(self) -> LoadGen:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()
