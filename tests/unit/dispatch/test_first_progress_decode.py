"""FirstProgressDeadline once the KV is there: a request waiting in its decode's admission
queue (SGLang admits into the running batch only what fits) is kept while the decode works
through it, and cut as before when the decode is idle, stuck or frozen."""

from __future__ import annotations

import asyncio
import time

from gateway.cancel import Interrupt
from gateway.dispatch.first_progress import FirstProgressDeadline
from gateway.servers.load import ServerLoad
from gateway.servers.pool import Server
from gateway.timers import Timers

WINDOW = 0.4  # the learned gap deadline the move gives (short: a unit test)


def decode() -> Server:
    return Server(url="http://d0", role="decode", verified=True, model="m")


async def busy(server: Server, waiting: int, serving: bool, until: float) -> None:
    """The decode's /v1/loads answered every 50 ms; `serving`: its other requests finish."""
    while time.monotonic() < until:
        server.load = ServerLoad(updated_at=time.monotonic(), waiting=waiting)
        if serving:
            server.last_success = time.monotonic()
        await asyncio.sleep(0.05)


async def silence(waiting: int, serving: bool, frozen_after: float = 10.0) -> float:
    """Seconds from the KV's arrival (the move) to the cut, or at most 2 s."""
    loop = asyncio.get_running_loop()
    timers = Timers(resolution=0.01)
    server = decode()
    server.load = ServerLoad(updated_at=time.monotonic(), waiting=waiting)
    waiter = asyncio.ensure_future(asyncio.sleep(10))  # what the interrupt stops
    interrupt = Interrupt(waiter, loop=loop)
    now = loop.time()
    deadline = FirstProgressDeadline(timers, interrupt, now + 30.0, now + 60.0, None, server)
    started = loop.time()
    deadline.move(started + WINDOW)  # the prefill answered: the decode's gap from here
    poller = asyncio.ensure_future(busy(server, waiting, serving,
                                        time.monotonic() + min(frozen_after, 2.0)))
    try:
        while not interrupt.fired and loop.time() - started < 2.0:
            await asyncio.sleep(0.01)
        return loop.time() - started
    finally:
        deadline.cancel()
        poller.cancel()
        waiter.cancel()


def test_a_request_in_a_moving_decode_queue_is_kept():
    assert asyncio.run(silence(waiting=4, serving=True)) >= 2.0


def test_an_idle_or_stuck_decode_cuts_it_at_the_learned_deadline():
    assert asyncio.run(silence(waiting=0, serving=True)) < WINDOW + 0.15  # no queue there
    # a queue that does not move: cut once the probe saw nothing happen
    assert asyncio.run(silence(waiting=4, serving=False)) < 1.5 * WINDOW + 0.15


def test_a_decode_frozen_while_it_holds_the_request_is_cut_within_a_window():
    cut = asyncio.run(silence(waiting=4, serving=True, frozen_after=0.8))
    assert 0.8 < cut < 0.8 + WINDOW + 0.2
