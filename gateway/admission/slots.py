"""Admission: a concurrency limit with a bounded, timed, fair wait queue.

`acquire` takes one of `--max-concurrency` slots at once when one is free: that path is a
comparison and a counter (and, with `--workers`, the shared-memory slot take). When none is
free the request waits in the `FairQueue` (gateway/admission/fair_queue.py): tenants by weight, classes
in order within a tenant. A finishing request hands its slot straight to the next waiter in
that order, so nobody overtakes the queue.

Leaving the queue early:
* queue full (`--max-queue`): an arrival sheds the youngest waiter of the lowest class below
  its own (429, `shed`), or, when none is lower, is refused itself (429, `queue_full`);
* waited `--queue-timeout`: 503; the client's own deadline (`--deadline-header`) came first:
  504; either way the request's work never starts, and a waiter whose deadline has passed is
  never granted a slot;
* the client left or the request was aborted: the request's `Interrupt` cancels the wait and
  the waiter leaves the queue at once (no slot is taken, none is lost).
Retry-After grows with the class (batch clients come back later), see `RETRY_AFTER`.

With `--workers N` the limit holds for the gateway as a whole: slots are taken in shared
memory (gateway/processes/shared_state.py) and each worker orders its own queue. A worker publishes its
most urgent waiter (class, and since when) there; a slot is handed to a local waiter, or
taken from the shared pool by the poller (slots freed elsewhere are seen within `POLL`
seconds), only while no other worker has a waiter ahead of it: a more urgent class, or the
same class waiting longer. So classes hold across workers and no worker's waiters starve;
weights are honoured within each worker (docs/TENANCY.md). `--max-queue` bounds the gateway's
queue too: each worker publishes how many wait in it, and a new waiter takes its place in
that count under the lock (`SharedState.try_queue`); a worker sheds only its own waiters.
"""

from __future__ import annotations

import asyncio
import time

from gateway.admission.auth import ANONYMOUS
from gateway.admission.fair_queue import FairQueue
from gateway.admission.tenancy import Tenant
from gateway.config.tenants import DEFAULT_SETTINGS, PRIORITIES, STANDARD
from gateway.errors import GatewayTimeout, ServiceUnavailable, TooManyRequests
from gateway.observability.metrics import Metrics
from gateway.timers import Timers

POLL = 0.005  # seconds between looks at slots other workers freed
# Retry-After seconds per class (interactive, standard, batch): queue full or shed; timed out
RETRY_AFTER = {"full": ("1", "1", "5"), "timeout": ("1", "2", "10")}


class Waiter:
    """One request waiting for a slot."""

    __slots__ = ("future", "tenant", "klass", "since", "timer", "by_client")

    def __init__(self, future: asyncio.Future, tenant: Tenant, klass: int, since: float) -> None:
        self.future = future
        self.tenant = tenant
        self.klass = klass
        self.since = since
        self.timer = None  # its expiry: the queue timeout, or the client's deadline if sooner
        self.by_client = False  # the expiry is the client's deadline


class Admission:
    def __init__(self, max_concurrency: int, max_queue: int, queue_timeout: float,
                 metrics: Metrics, shared=None, timers: Timers | None = None) -> None:
        self.limit = max_concurrency  # 0: unlimited
        self.max_queue = max_queue
        self.queue_timeout = queue_timeout
        self.metrics = metrics
        self.active = 0
        self.shared = shared  # (SharedState, worker id) with --workers
        self.timers = timers or Timers()
        self._queue = FairQueue(len(PRIORITIES))
        self._poller: asyncio.Task | None = None
        self._anonymous = Tenant(ANONYMOUS, DEFAULT_SETTINGS)
        self._outcomes: dict[tuple[str, int, str], object] = {}
        self._waits: dict[tuple[str, int], object] = {}
        metrics.watch_admission(self)

    @property
    def queued(self) -> int:
        return len(self._queue)

    def waiting(self) -> dict[tuple[str, str], int]:
        """Waiters per (tenant, class name), for the metrics."""
        return {(t, PRIORITIES[k]): n for (t, k), n in self._queue.waiting().items()}

    async def acquire(self, tenant: Tenant | None = None, klass: int = STANDARD,
                      deadline: float | None = None) -> None:
        """Hold one of the `limit` slots until `release()`; `deadline` (loop time) is the
        client's own. Raises TooManyRequests, ServiceUnavailable or GatewayTimeout."""
        tenant = tenant or self._anonymous
        if deadline is not None and deadline <= self.timers.loop().time():
            raise self._refuse(tenant, klass, "deadline", self._late())  # start no work
        if self.limit and not self._take():
            await self._wait(tenant, klass, deadline)
        else:
            self.active += 1
        counter = tenant.admitted[klass]
        if counter is None:
            counter = tenant.admitted[klass] = self._counter(tenant.name, klass, "admitted")
        counter.pending += 1

    def release(self) -> None:
        """The request is done: its slot goes to the next waiter, else back to the pool."""
        if self._queue.size and not self._yields():
            now = self.timers.loop().time()
            while (waiter := self._queue.pop()) is not None:
                if self._grant(waiter, now):
                    self._publish()
                    return  # the slot moves to the waiter; `active` unchanged
            self._publish()
        self.active -= 1
        if self.shared is not None and self.limit:
            state, worker = self.shared
            state.release(worker)

    # -- waiting -------------------------------------------------------------------------------

    async def _wait(self, tenant: Tenant, klass: int, deadline: float | None) -> None:
        loop = self.timers.loop()
        now = loop.time()
        if not self._room():
            self._make_room(tenant, klass)
        waiter = Waiter(loop.create_future(), tenant, klass, now)
        expiry = now + self.queue_timeout
        waiter.by_client = by_client = deadline is not None and deadline < expiry
        waiter.timer = self.timers.at(deadline if by_client else expiry, self._expire, waiter)
        self._queue.push(tenant.name, tenant.weight, klass, waiter)
        self._count(tenant.name, klass, "queued")
        self._publish()
        self._watch_others()
        started = time.perf_counter()
        try:
            await waiter.future
        except asyncio.CancelledError:  # the client left, or an abort
            future = waiter.future
            if not future.done() or future.cancelled():
                if self._queue.remove(tenant.name, klass, waiter):
                    self._publish()
            elif future.exception() is None:
                self.release()  # granted at the last moment: pass the slot on
            else:  # refused at the last moment (counted so): it never held a slot
                raise
            self._count(tenant.name, klass, "left")
            raise
        finally:
            waiter.timer.cancel()
            waited = time.perf_counter() - started
            self.metrics.queue_time.observe(waited)
            self._wait_histogram(tenant.name, klass).observe(waited)

    def _room(self) -> bool:
        """Room for one more waiter: in this process, or with workers in the gateway's
        queue as a whole (one locked take in shared memory, on the waiting path only)."""
        if self.shared is None:
            return len(self._queue) < self.max_queue
        state, worker = self.shared
        return state.try_queue(worker, self.max_queue, len(self._queue))

    def _make_room(self, tenant: Tenant, klass: int) -> None:
        """The queue is full: shed a waiter of a lower class, or refuse this arrival. Only
        this worker's waiters can be shed: a lower one in another worker does not make room
        (docs/WORKERS.md). The arrival takes the victim's place at once (nothing published
        between), so no other worker takes that place meanwhile."""
        shed = self._queue.evict_below(klass)
        if shed is None:
            raise self._refuse(tenant, klass, "queue_full", TooManyRequests(
                "gateway is at capacity and its queue is full; retry later",
                headers={"retry-after": RETRY_AFTER["full"][klass]}))
        victim: Waiter = shed[2]
        victim.timer.cancel()
        if not victim.future.done():  # else its task is leaving already (cancelled)
            victim.future.set_exception(self._refuse(victim.tenant, victim.klass, "shed",
                                                     TooManyRequests(
                "shed from the queue for a request of a higher priority class; retry later",
                headers={"retry-after": RETRY_AFTER["full"][victim.klass]})))

    def _expire(self, waiter: Waiter) -> None:
        """The waiter's time is up (a Timers callback): it leaves without a slot."""
        if waiter.future.done():
            return
        self._queue.remove(waiter.tenant.name, waiter.klass, waiter)
        self._publish()
        waiter.future.set_exception(self._timed_out(waiter))

    def _grant(self, waiter: Waiter, now: float) -> bool:
        """Give the slot to `waiter`, unless it is gone or its deadline passed meanwhile."""
        if waiter.future.done():
            return False
        timer = waiter.timer
        if timer is not None and timer.when <= now:  # due, its callback not yet run
            waiter.future.set_exception(self._timed_out(waiter))
            return False
        waiter.future.set_result(None)
        return True

    def _timed_out(self, waiter: Waiter) -> Exception:
        if waiter.by_client:
            return self._refuse(waiter.tenant, waiter.klass, "deadline", self._late())
        return self._refuse(waiter.tenant, waiter.klass, "queue_timeout", ServiceUnavailable(
            f"no capacity within {self.queue_timeout:g}s; retry later",
            headers={"retry-after": RETRY_AFTER["timeout"][waiter.klass]}))

    @staticmethod
    def _late() -> GatewayTimeout:
        return GatewayTimeout("the request's deadline passed while it waited for capacity; "
                              "nothing was sent to a server")

    def _refuse(self, tenant: Tenant, klass: int, outcome: str, error: Exception) -> Exception:
        self.metrics.rejections.labels(outcome).inc()
        self._count(tenant.name, klass, outcome)
        return error

    # -- slots -------------------------------------------------------------------------------

    def _take(self) -> bool:
        """A free slot for a new request (never ahead of this worker's waiters)."""
        if self._queue.size:
            return False
        if self.shared is None:
            return self.active < self.limit
        state, worker = self.shared
        return state.try_admit(worker, self.limit)

    def _yields(self) -> bool:
        """With workers: another worker has a waiter ahead of this one's most urgent."""
        if self.shared is None:
            return False
        state, worker = self.shared
        head = self._head()
        return head is not None and state.waits_longer_elsewhere(worker, head.klass, head.since)

    def _head(self) -> Waiter | None:
        """The most urgent class's longest waiter here."""
        klass = self._queue.best_class()
        if klass is None:
            return None
        return min(self._queue.heads(klass), key=lambda w: w.since)

    def _publish(self) -> None:
        if self.shared is not None:
            state, worker = self.shared
            head = self._head()
            state.publish_waiting(worker, None if head is None else head.klass,
                                  0.0 if head is None else head.since, len(self._queue))

    def _watch_others(self) -> None:
        """With workers: while waiters queue here, look for slots freed in other workers."""
        if self.shared is not None and (self._poller is None or self._poller.done()):
            self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def _poll(self) -> None:
        state, worker = self.shared
        loop = self.timers.loop()
        while self._queue.size:
            await asyncio.sleep(POLL)
            while self._queue.size and not self._yields() and state.try_admit(worker,
                                                                              self.limit):
                now = loop.time()
                while (waiter := self._queue.pop()) is not None:
                    if self._grant(waiter, now):
                        self.active += 1
                        break
                else:
                    state.release(worker)
                self._publish()

    # -- metrics -----------------------------------------------------------------------------

    def _counter(self, tenant: str, klass: int, outcome: str):
        key = (tenant, klass, outcome)
        counter = self._outcomes.get(key)
        if counter is None:
            m = self.metrics
            counter = self._outcomes[key] = m.buffered_counter(
                m.admission_outcomes.labels(tenant, PRIORITIES[klass], outcome))
        return counter

    def _count(self, tenant: str, klass: int, outcome: str) -> None:
        self._counter(tenant, klass, outcome).inc()

    def _wait_histogram(self, tenant: str, klass: int):
        key = (tenant, klass)
        histogram = self._waits.get(key)
        if histogram is None:
            m = self.metrics
            histogram = self._waits[key] = m.buffered_histogram(
                m.tenant_queue_time.labels(tenant, PRIORITIES[klass]))
        return histogram
