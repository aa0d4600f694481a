"""State the worker processes of one gateway share (`--workers N`), in one shared-memory block.

Why shared memory: the figures are read on every request (in-flight counts for the load-aware
policies, the concurrency limit, per-key rate limits), so a round trip to another process per
request would cost more than the request. Each worker writes only its own column of a counter
(its own count, as an absolute value: no read-modify-write race between processes), and
readers sum the columns; an aligned 8-byte store is atomic on the machines we run on.
Decisions that must be exact across workers (admission slots, token buckets, claiming a
server's slot) take a file lock (`fcntl.flock`), a few microseconds, only when that feature is
configured.

Layout (8-byte words): a header; per worker: active requests; per server slot: the URL's hash,
then in-flight requests and in-flight prompt tokens per worker; per API key: two token
buckets (requests, prompt tokens: gateway/admission/key_limits.py), each (tokens, last refill time) as
doubles; per worker: its most urgent waiter's class and wait start (gateway/admission/slots.py);
per worker: its open client connections (gateway/processes/fair_accept.py); per worker: its
waiters, so that `--max-queue` bounds the gateway's queue, not each worker's; then the table of
where each process sent its prompts (gateway/prefix/shared.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
import zlib
from collections.abc import Iterator
from multiprocessing import resource_tracker, shared_memory

from gateway.admission.key_limits import take
from gateway.prefix.shared import WORDS as PREFIX_WORDS
from gateway.prefix.shared import SharedPrefixes

SERVER_SLOTS = 1024
OTHERS_TTL = 0.005  # seconds the other workers' in-flight sums are reused
MAGIC = 0x70646777  # "pdgw"
DEAD_CONNECTIONS = 1 << 40  # an exited worker's connections: never the fewest


def url_hash(url: str) -> int:
    """A non-zero 63-bit hash of a server URL (0 marks an empty slot)."""
    value = (zlib.crc32(url.encode()) << 31) ^ zlib.adler32(url.encode())
    return (value & ((1 << 63) - 1)) or 1


class SharedState:
    """One gateway's shared block, attached by every worker (created by the supervisor)."""

    def __init__(self, name: str, workers: int, keys: int, lock_path: str,
                 create: bool = False) -> None:
        self.workers = workers
        self.keys = keys
        self.lock_path = lock_path
        self._active = 1
        self._hashes = self._active + workers
        self._in_flight = self._hashes + SERVER_SLOTS
        self._tokens = self._in_flight + SERVER_SLOTS * workers
        self._buckets = self._tokens + SERVER_SLOTS * workers
        self._waiting = self._buckets + 4 * max(keys, 1)
        self._connections = self._waiting + 2 * workers
        self._queued = self._connections + workers
        self._prefixes = self._queued + workers
        words = self._prefixes + PREFIX_WORDS
        if create:
            self.shm = shared_memory.SharedMemory(name=name, create=True, size=8 * words)
            self.shm.buf[: 8 * words] = bytes(8 * words)
        else:
            self.shm = shared_memory.SharedMemory(name=name)
            # Python 3.11 registers an attached block with the resource tracker, which
            # unlinks it when this worker exits (taking it from the others): the supervisor
            # owns it, so the worker lets go of that registration.
            resource_tracker.unregister(self.shm._name, "shared_memory")
        self.words = self.shm.buf.cast("q")
        self.floats = self.shm.buf.cast("d")
        if create:
            self.words[0] = MAGIC
            for worker in range(workers):
                self.words[self._waiting + 2 * worker] = -1  # nobody waits yet
        elif self.words[0] != MAGIC:
            raise RuntimeError(f"shared block {name} is not a gateway's")
        self.prefixes = SharedPrefixes(self.words[self._prefixes:self._prefixes + PREFIX_WORDS])
        self._slots: dict[str, int] = {}
        self._lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    # -- servers -----------------------------------------------------------------------------

    def slot(self, url: str) -> int:
        """The server's slot, the same in every worker (claimed under the lock once)."""
        slot = self._slots.get(url)
        if slot is not None:
            return slot
        wanted = url_hash(url)
        start = wanted % SERVER_SLOTS
        with self.locked():
            for step in range(SERVER_SLOTS):
                index = (start + step) % SERVER_SLOTS
                held = self.words[self._hashes + index]
                if held == wanted or held == 0:
                    self.words[self._hashes + index] = wanted
                    self._slots[url] = index
                    return index
        raise RuntimeError(f"no free server slot for {url} ({SERVER_SLOTS} in use)")

    def share(self, url: str, worker: int) -> ServerShare:
        """The server's column for `worker`: what its `Server` writes and reads per request."""
        first = self.slot(url) * self.workers
        return ServerShare(self.words, self._in_flight + first, self._tokens + first,
                           self.workers, worker)

    def try_admit(self, worker: int, limit: int) -> bool:
        """Take one of the gateway-wide `limit` slots for this worker, if one is free."""
        with self.locked():
            active = self.words[self._active:self._active + self.workers]
            if sum(active) >= limit:
                return False
            self.words[self._active + worker] += 1
            return True

    def release(self, worker: int) -> None:
        with self.locked():
            self.words[self._active + worker] -= 1

    def active(self) -> int:
        return sum(self.words[self._active:self._active + self.workers])

    def forget_worker(self, worker: int) -> None:
        """`worker` exited: what it published stops counting. Its admission slots would
        otherwise hold the gateway's capacity, its legs would stay in every server's load, and
        its published waiter would make every other worker's queue yield to a request that is
        gone (until its successor overwrote each figure, if ever). The supervisor calls this
        once the process is gone, so nothing writes these words meanwhile; its connections
        read as many, so that no live worker leaves a connection to it."""
        words = self.words
        with self.locked():
            words[self._active + worker] = 0
            words[self._queued + worker] = 0  # its waiters are gone with it
        words[self._waiting + 2 * worker] = -1
        words[self._connections + worker] = DEAD_CONNECTIONS
        for column in (self._in_flight, self._tokens):
            for slot in range(column + worker, column + SERVER_SLOTS * self.workers,
                              self.workers):
                words[slot] = 0

    def publish_waiting(self, worker: int, klass: int | None, since: float,
                        queued: int = 0) -> None:
        """This worker's most urgent waiter: its class (None: nobody waits here) and since
        when it waits (gateway/admission/slots.py), and how many wait here. The count may go
        down without the lock (only this worker writes it; a stale higher figure only makes
        another worker's `try_queue` refuse once); it goes up only in `try_queue`."""
        at = self._waiting + 2 * worker
        self.floats[at + 1] = since
        self.words[at] = -1 if klass is None else klass
        self.words[self._queued + worker] = queued

    def try_queue(self, worker: int, limit: int, mine: int) -> bool:
        """Count one more waiter for `worker` (which has `mine`), if fewer than `limit` wait
        gateway-wide. Under the lock, and counted before the waiter is pushed, so that two
        workers never both take the queue's last place (the same care as `try_admit`)."""
        at = self._queued
        with self.locked():
            if sum(self.words[at:at + self.workers]) - self.words[at + worker] + mine >= limit:
                return False
            self.words[at + worker] = mine + 1
            return True

    def queued(self) -> int:
        """Waiters in every worker together."""
        return sum(self.words[self._queued:self._queued + self.workers])

    def waits_longer_elsewhere(self, worker: int, klass: int, since: float) -> bool:
        """Whether another worker has a waiter ahead of (klass, since): of a more urgent
        class, or of the same class waiting since earlier. No lock: each worker writes only
        its own two words, and a torn read only delays a slot by one poll."""
        words, floats = self.words, self.floats
        for other in range(self.workers):
            at = self._waiting + 2 * other
            theirs = words[at]
            if other != worker and theirs >= 0 and (
                    theirs < klass or (theirs == klass and floats[at + 1] < since)):
                return True
        return False

    # -- client connections -------------------------------------------------------------------

    def publish_connections(self, worker: int, count: int) -> None:
        """This worker's open client connections, as it counts them when one waits."""
        self.words[self._connections + worker] = count

    def fewest_connections_elsewhere(self, worker: int) -> int:
        """The fewest open connections another worker published (no lock: a stale figure
        is one that has not yet counted the closes since, so it is never too low for a
        live worker)."""
        column = self.words[self._connections:self._connections + self.workers]
        return min((n for i, n in enumerate(column) if i != worker), default=0)

    # -- per-key token buckets ----------------------------------------------------------------

    def take_from_bucket(self, key: int, kind: int, rate: float, burst: float, cost: float,
                         now: float) -> float:
        """Take `cost` from bucket `kind` of key number `key`, gateway-wide: 0.0 if taken,
        else the seconds until it would be there (key_limits.take is the rule)."""
        at = self._buckets + 4 * key + 2 * kind
        with self.locked():
            tokens, last, wait = take(self.floats[at], self.floats[at + 1], now, rate, burst,
                                      cost)
            self.floats[at], self.floats[at + 1] = tokens, last
            return wait

    def close(self, unlink: bool = False) -> None:
        self.prefixes.words.release()
        self.words.release()
        self.floats.release()
        self.shm.close()
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                self.shm.unlink()
        os.close(self._lock_fd)


class ServerShare:
    """One server's figures in the shared block, as one worker sees them: its own in-flight
    requests and prompt tokens written, the other workers' summed. `Server` calls it on every
    request (four writes, a read per candidate), so the slot's word indices are worked out
    once, here, and the other workers' sums are kept on the object for `OTHERS_TTL`: the
    policies ask for every candidate on every request, and the others' share of a server's
    load is not worth a fresh sum each time (the caller adds its own count, which is exact)."""

    __slots__ = ("words", "flight", "tokens", "columns", "until", "cached")

    def __init__(self, words: memoryview, flight: int, tokens: int, workers: int,
                 worker: int) -> None:
        """`flight`, `tokens`: the first word of the server's two columns of `workers`."""
        self.words = words
        self.columns = (flight, tokens, workers)
        self.flight = flight + worker  # this worker's own two words
        self.tokens = tokens + worker
        self.until = 0.0  # time.monotonic() until which `cached` holds
        self.cached = (0, 0)

    def publish(self, in_flight: int, tokens: int) -> None:
        """This worker's own in-flight figures for the server."""
        words = self.words
        words[self.flight] = in_flight
        words[self.tokens] = tokens

    def others(self, now: float | None = None) -> tuple[int, int]:
        """The other workers' in-flight requests and prompt tokens, at most `OTHERS_TTL` old
        (`now`: time.monotonic(), when the caller has it)."""
        if now is None:
            now = time.monotonic()
        if now < self.until:
            return self.cached
        flight, tokens, workers = self.columns
        words = self.words
        cached = self.cached = (sum(words[flight:flight + workers]) - words[self.flight],
                                sum(words[tokens:tokens + workers]) - words[self.tokens])
        self.until = now + OTHERS_TTL
        return cached
