"""How a serving process accepts client connections: in batches from a queue of its own, one
per wake-up from the listening socket that every worker shares.

Why not uvloop's own accept, in either case:

* A busy process starves new connections. While its loop is busy serving, uvloop's server
  (uvloop 0.23) accepted a burst of 288 new connections over 6.2 s, about one per loop
  iteration; asyncio's over 1.3 s, and this listener, taking up to `ACCEPT_BATCH` per
  wake-up on uvloop, over 0.24 s (`python -m loadtests.accept_burst`). On the 16-core device
  machine a single gateway that a closed loop kept busy made the first request of 288 new
  connections wait up to 2.8 s, all of it before the connection was accepted (docs/WORKERS.md,
  "Which worker accepts"): a new client, or a Kubernetes probe (a new connection each time),
  waits seconds while the clients already connected are served in milliseconds. So a
  process that owns its queue (a single gateway, or a worker with its own SO_REUSEPORT
  socket) accepts up to `ACCEPT_BATCH` connections per wake-up.
* Workers sharing one socket: when a client pool opens its connections in a burst, the first
  worker to wake takes nearly all of them and keeps them for as long as they live
  (keep-alive). Measured (docs/WORKERS.md, "One
socket or SO_REUSEPORT"): `python -m loadtests.scaling --workers 2 --quick --targets gateway
--no-pin` left one of two workers at 0.01 cores in 3 of 4 runs; on the 16-core device
machine one of 8 workers served 0.02 cores. `UV_TCP_SINGLE_ACCEPT=1` (libuv's own switch)
did not help on 2 cores. nginx's `multi_accept off` is the cure used here for a shared
socket: take one connection, go back to the loop, and let a worker that is less busy take the
next one.

One accept per wake-up is not enough by itself: when connections come one after another, the
worker that wakes fastest (often the one already running) takes each of them (36 of 36 over
3 workers in `tests/integration/test_workers.py`). So a worker that holds more than `SLACK`
connections over a sibling leaves the connection to it, for at most `MAX_DEFER`: each worker
publishes its open connections in the shared block as it looks (`ConnectionShare.ahead`). A
published figure has not counted the closes since, so it is never too low for a live worker
and the worker with the fewest always takes; a worker that died with few is waited for only
`MAX_DEFER`, then the others take again.

Every worker waiting on the socket wakes for each new connection (no EPOLLEXCLUSIVE through
uvloop); all but one find nothing (EAGAIN). That costs a failed system call per worker per
new connection, not per request on a kept-alive connection.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import ssl
from collections.abc import Callable

log = logging.getLogger(__name__)

RETRY_AFTER_EMFILE = 1.0  # seconds without accepting after the process ran out of files
SLACK = 1  # connections a worker may hold over its least busy sibling and still accept
MAX_DEFER = 0.02  # seconds a worker ahead of its siblings leaves a connection to them
DEFER_STEP = 0.002  # seconds between two looks while deferring
OUT_OF_FILES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
# connections a process that owns its queue accepts per wake-up (asyncio's own loop takes up
# to its backlog, 100 by default): enough for a burst, bounded so that one wake-up does not
# hold the loop for long (about 30 us each: the protocol's state and a task)
ACCEPT_BATCH = 64


class ConnectionShare:
    """This worker's open client connections against its siblings' (the shared block)."""

    def __init__(self, shared, worker: int, open_here: Callable[[], int]) -> None:
        self.shared, self.worker, self.open_here = shared, worker, open_here
        shared.publish_connections(worker, 0)  # a restarted worker starts with none

    def ahead(self) -> bool:
        """Whether another worker holds more than `SLACK` connections fewer than this one."""
        mine = self.open_here()
        self.shared.publish_connections(self.worker, mine)
        return mine > self.shared.fewest_connections_elsewhere(self.worker) + SLACK


class FairListener:
    """Accepts from `sock` and serves each connection with `protocol`: one per readiness
    callback when `share` says the socket is shared with sibling workers, else up to
    `ACCEPT_BATCH`; duck-types the `close`/`wait_closed` of asyncio's Server for uvicorn."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket,
                 protocol: Callable[[], asyncio.Protocol],
                 tls: ssl.SSLContext | None = None,
                 share: ConnectionShare | None = None) -> None:
        self.loop, self.sock, self.protocol, self.tls = loop, sock, protocol, tls
        self.share = share
        self.batch = 1 if share is not None else ACCEPT_BATCH
        self.fd = sock.fileno()
        self.opening: set[asyncio.Task] = set()  # connections handed to the loop, not yet made
        self.closed = False
        self.deferred_since = self.last_defer = -1.0
        sock.setblocking(False)
        loop.add_reader(self.fd, self.accept_ready)

    def accept_ready(self) -> None:
        """Accept what waits, up to `batch` connections (until the queue is empty)."""
        if self.share is not None and self.share.ahead() and self._defer():
            return
        for _ in range(self.batch):
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):  # none left, or a sibling took it
                return
            except OSError as exc:
                if exc.errno in OUT_OF_FILES:  # as asyncio does: stop a while, do not spin
                    log.warning("accept failed (%s); not accepting for %.0f s", exc,
                                RETRY_AFTER_EMFILE)
                    self.loop.remove_reader(self.fd)
                    self.loop.call_later(RETRY_AFTER_EMFILE, self._resume)
                else:
                    log.warning("accept failed: %s", exc)
                return
            conn.setblocking(False)
            task = self.loop.create_task(self._serve(conn))
            self.opening.add(task)
            task.add_done_callback(self.opening.discard)

    def _defer(self) -> bool:
        """Leave the waiting connection to a sibling for a moment, unless this episode of
        deferring has lasted `MAX_DEFER` (a sibling that died or hangs never takes it)."""
        now = self.loop.time()
        if now - self.last_defer > 2 * DEFER_STEP:  # a new connection: a new episode
            self.deferred_since = now
        self.last_defer = now
        if now - self.deferred_since >= MAX_DEFER:
            return False
        self.loop.remove_reader(self.fd)
        self.loop.call_later(DEFER_STEP, self._resume)
        return True

    async def _serve(self, conn: socket.socket) -> None:
        try:
            await self.loop.connect_accepted_socket(self.protocol, conn, ssl=self.tls)
        except (OSError, ssl.SSLError) as exc:  # reset, or a failed TLS handshake
            log.debug("connection not opened: %s", exc)
            conn.close()

    def _resume(self) -> None:
        if not self.closed:
            self.loop.add_reader(self.fd, self.accept_ready)

    def close(self) -> None:
        """Stop accepting, after taking what the socket's queue holds: those clients have
        connected, often sent their request too, and closing the socket would reset them
        (the socket stays open: its owner closes it; uvicorn closes the sockets it was
        given at shutdown, right after)."""
        if not self.closed:
            self.closed = True
            self.loop.remove_reader(self.fd)
            self.share, self.batch = None, 1 << 30  # no sibling takes them now: all of them
            self.accept_ready()

    async def wait_closed(self) -> None:
        if self.opening:
            await asyncio.gather(*self.opening, return_exceptions=True)
