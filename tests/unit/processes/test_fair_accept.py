"""The gateway's accept. Workers on a shared socket: one connection per wake-up, left to a
sibling that holds fewer, but never for longer than `MAX_DEFER` (a sibling that died with few
connections must not stop the others). A process that owns its queue: a burst in one
wake-up, up to `ACCEPT_BATCH`. Real sockets on loopback, a real event loop."""

from __future__ import annotations

import asyncio
import socket

from gateway.processes.fair_accept import (
    ACCEPT_BATCH,
    MAX_DEFER,
    ConnectionShare,
    FairListener,
)


class Column:
    """The shared block's connection column, for two workers."""

    def __init__(self, other: int) -> None:
        self.counts = {0: 0, 1: other}

    def publish_connections(self, worker: int, count: int) -> None:
        self.counts[worker] = count

    def fewest_connections_elsewhere(self, worker: int) -> int:
        return min(n for w, n in self.counts.items() if w != worker)


class Made(asyncio.Protocol):
    def __init__(self, made: list) -> None:
        self.made = made

    def connection_made(self, transport) -> None:
        self.made.append(asyncio.get_running_loop().time())


async def connect_once(open_here: int, other: int) -> tuple[float, list, Column]:
    """Whether the listener deferred (-1.0: never, else when it began) and the connections
    it made, this worker holding `open_here` connections and its sibling `other`."""
    loop = asyncio.get_running_loop()
    listening = socket.create_server(("127.0.0.1", 0))
    column = Column(other)
    made: list[float] = []
    share = ConnectionShare(column, 0, lambda: open_here)
    listener = FairListener(loop, listening, lambda: Made(made), share=share)
    try:
        started = loop.time()
        client = socket.create_connection(listening.getsockname(), timeout=5)
        while not made and loop.time() - started < 5:
            await asyncio.sleep(0.001)
        client.close()
        assert made, "the connection was never accepted"
        return listener.deferred_since, made, column
    finally:
        listener.close()
        await listener.wait_closed()
        listening.close()


def test_a_worker_with_no_more_than_its_siblings_accepts_at_once():
    deferred, made, column = asyncio.run(connect_once(open_here=3, other=2))
    assert len(made) == 1
    assert deferred == -1.0  # SLACK: one over the sibling still accepts, without waiting
    assert column.counts[0] == 3  # published when it looked


def test_a_worker_ahead_of_a_sibling_leaves_it_the_connection_then_takes_it():
    """The sibling never accepts here (as if it died with 0 connections published): the
    worker ahead takes the connection after deferring, not never."""
    deferred, made, _ = asyncio.run(connect_once(open_here=5, other=0))
    assert len(made) == 1
    assert deferred >= 0.0
    assert made[0] - deferred >= MAX_DEFER  # it waited its whole deferral first


def test_closing_stops_accepting_and_leaves_the_socket_open():
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        listening = socket.create_server(("127.0.0.1", 0))
        made: list[float] = []
        listener = FairListener(loop, listening, lambda: Made(made))
        listener.close()
        client = socket.create_connection(listening.getsockname(), timeout=5)
        await asyncio.sleep(0.05)
        assert made == []
        assert listening.fileno() != -1  # the supervisor and the siblings still own it
        client.close()
        listening.close()

    asyncio.run(scenario())


async def one_wake_up(waiting: int, share: ConnectionShare | None) -> tuple[int, int]:
    """`waiting` connections in the queue, one readiness callback: how many it took, and how
    many connections were made once the loop had run."""
    loop = asyncio.get_running_loop()
    listening = socket.create_server(("127.0.0.1", 0), backlog=256)
    clients = [socket.create_connection(listening.getsockname(), timeout=5)
               for _ in range(waiting)]  # the kernel completes them: they wait to be accepted
    made: list[float] = []
    listener = FairListener(loop, listening, lambda: Made(made), share=share)
    try:
        listener.accept_ready()  # the wake-up, before the loop gets to run it again
        taken = len(listener.opening)
        started = loop.time()
        while len(made) < waiting and loop.time() - started < 5:
            await asyncio.sleep(0.005)
        return taken, len(made)
    finally:
        listener.close()
        await listener.wait_closed()
        for client in clients:
            client.close()
        listening.close()


def test_a_process_that_owns_its_queue_takes_a_burst_in_one_wake_up():
    """A busy loop wakes its listener once per iteration: one connection per wake-up left a
    burst waiting seconds behind the requests already served (docs/BENCHMARKS.md)."""
    taken, made = asyncio.run(one_wake_up(40, share=None))
    assert taken == 40
    assert made == 40


def test_the_batch_is_bounded():
    taken, made = asyncio.run(one_wake_up(ACCEPT_BATCH + 6, share=None))
    assert taken == ACCEPT_BATCH  # the rest at the next wake-up
    assert made == ACCEPT_BATCH + 6


def test_a_worker_on_the_shared_socket_still_takes_one_per_wake_up():
    taken, made = asyncio.run(one_wake_up(5, share=ConnectionShare(Column(other=9), 0,
                                                                    lambda: 0)))
    assert taken == 1  # the siblings may take the others
    assert made == 5  # (here none runs: this worker takes them all, one wake-up each)


def test_closing_takes_the_connections_already_queued():
    """At shutdown the socket closes right after its listener: clients queued on it (their
    request often sent) were reset. Closing takes them all, on a shared socket too."""
    async def scenario(share: ConnectionShare | None) -> int:
        loop = asyncio.get_running_loop()
        listening = socket.create_server(("127.0.0.1", 0), backlog=256)
        made: list[float] = []
        listener = FairListener(loop, listening, lambda: Made(made), share=share)
        clients = [socket.create_connection(listening.getsockname(), timeout=5)
                   for _ in range(ACCEPT_BATCH + 6)]
        listener.close()  # before the loop ran the listener once
        await listener.wait_closed()
        for client in clients:
            client.close()
        listening.close()
        return len(made)

    assert asyncio.run(scenario(None)) == ACCEPT_BATCH + 6
    ahead = ConnectionShare(Column(other=0), 0, lambda: 9)  # would leave them to a sibling
    assert asyncio.run(scenario(ahead)) == ACCEPT_BATCH + 6
