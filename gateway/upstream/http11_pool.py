"""Connections of the data-path client to one server: keep-alive reuse and a cap with waiting.

A pool holds at most `limit` connections to its server, counting those in use (`active`),
those kept alive between requests (`idle`) and those being opened or promised to a waiter
(`pending`). A request that finds none idle and the pool full waits in line (first come,
first served) for one to be released or closed, for at most `wait` seconds; then it fails with
`PoolTimeout`. While anyone waits there is never an idle connection nor room below the cap:
a released connection goes straight to the first waiter, and a closed one gives its place to
the first waiter. That is what keeps a burst from opening a connection per request (running
out of file descriptors, or overflowing the server's listen backlog and failing every
connect at once).

Nothing here resends anything: an idle connection the server has closed (its EOF was seen
before the request is written) is dropped and another one taken; see `HTTPClient.post`.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from typing import Generic, Protocol, TypeVar

IDLE_EXPIRY = 4.0  # below uvicorn's default keep-alive timeout (5 s): SGLang closes at 5 s


class Pooled(Protocol):
    """What the pool needs of a connection: whether it is still usable, and how to close it.
    The client's connection (`http11.py`) calls back `release` and `discard`."""

    closed: bool
    idle_since: float
    transport: asyncio.Transport | None

    def close(self) -> None: ...


C = TypeVar("C", bound=Pooled)


class HostPool(Generic[C]):
    def __init__(self, host: str, port: int, authority: str, limit: int) -> None:
        self.host = host
        self.port = port
        self.authority = authority  # the Host header: "host:port", "[::1]:port" for IPv6
        self.limit = limit
        self.tls: ssl.SSLContext | None = None  # https servers
        self.idle: collections.deque[C] = collections.deque()
        self.active: set[C] = set()
        self.pending = 0  # connects in progress and places handed to a waiter
        self.waiters: collections.deque[asyncio.Future] = collections.deque()
        self.heads: dict[str, bytes] = {}  # per path: the request head up to Content-Length

    @property
    def size(self) -> int:
        return len(self.active) + len(self.idle) + self.pending

    def take_idle(self) -> C | None:
        """The warmest live idle connection (now active), or None. Dead or expired ones are
        closed on the way: that is where a server's close of a kept-alive connection is
        noticed, before anything was written to it."""
        now = time.monotonic()
        while self.idle:
            connection = self.idle.pop()  # most recently used first
            if connection.closed or connection.transport.is_closing() \
                    or now - connection.idle_since > IDLE_EXPIRY:
                self.active.add(connection)  # counted until close() discards it
                connection.close()
                continue
            self.active.add(connection)
            return connection
        return None

    def release(self, connection: C) -> None:
        """A connection that finished a response cleanly: to the first waiter, else idle."""
        self.active.discard(connection)
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                self.active.add(connection)
                waiter.set_result(connection)
                return
        connection.idle_since = time.monotonic()
        self.idle.append(connection)

    def discard(self, connection: C) -> None:
        """A connection closed (by either side); idempotent."""
        if connection in self.active:
            self.active.remove(connection)
        else:
            try:
                self.idle.remove(connection)
            except ValueError:
                return  # not counted (any more)
        self.freed()

    def freed(self) -> None:
        """One place came free: promise it to the first waiter (who then connects)."""
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                self.pending += 1
                waiter.set_result(None)
                return

    async def wait(self, timeout: float) -> C | None:
        """Wait in line: a connection handed over, or None for a place to connect on (already
        counted in `pending`). Raises TimeoutError after `timeout` seconds."""
        waiter = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        try:
            async with asyncio.timeout(timeout):
                return await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self.give_back(waiter.result())  # handed over just as we gave up
            else:
                waiter.cancel()
                try:
                    self.waiters.remove(waiter)
                except ValueError:
                    pass
            raise

    def give_back(self, got: C | None) -> None:
        if got is None:
            self.pending -= 1
            self.freed()
        else:
            self.release(got)

    def fail_waiters(self, exc: Exception) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_exception(exc)

    def stats(self) -> dict[str, int]:
        return {"idle": len(self.idle), "active": len(self.active), "pending": self.pending,
                "waiting": sum(1 for w in self.waiters if not w.done()), "limit": self.limit}
