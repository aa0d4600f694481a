"""The gateway's side of Responses state: what a new turn needs from the store, what is kept
after it, and cancelling one in flight.

One `Responses` per serving process, built with the gateway and opened by the app's lifespan.
A store failure costs a request only when the request needs what the store holds: a turn with
`previous_response_id` gets 503 with Retry-After; a turn without one is served, its record
not kept (logged and counted in `gateway_responses_store_errors_total`), so a later turn that
names it gets 404 (docs/RESPONSES.md, "When the store is down").

Nothing but the turn's own end finishes its record, so a process that stops mid-turn (killed,
out of memory, its node lost) would leave it in_progress for its whole retention: its lease
(store.py), renewed here for every running turn in one write per period, lapses, and every
reader (GET, a next turn, a cancel, in any process) then reads it as failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter

from gateway.responses import history
from gateway.responses.store import (
    DELETED,
    RENEW_EVERY,
    Retention,
    SQLiteStore,
    Store,
    StoreDown,
)

log = logging.getLogger("gateway.responses")

SAVE_AGAIN = (1.0, 2.0, 4.0, 5.0)  # seconds between the rounds that try the pending final
# saves again (the last repeats), or sooner once a write here succeeds (the store is back)
SAVE_FOR = 60.0  # seconds a pending final save is tried before it is given up
WAKE_GAP = 0.25  # seconds at least between two rounds

REFUSED = {
    "background": "background responses are not supported by this gateway: send "
                  "background=false (or leave it out) and keep the connection open, or stream",
    "conversation": "'conversation' is not supported by this gateway: chain turns with "
                    "previous_response_id",
    "rid": "'rid' is assigned by the gateway (the response id)",
    "request_id": "'request_id' is assigned by the gateway (the response id)",
}


@dataclass(slots=True, eq=False)
class Turn:
    """One POST /v1/responses on its way: the id the client will see and what to keep."""

    rid: str
    tenant: str
    store: bool
    items: list  # the whole input the servers answer
    body: bytes  # what the inference endpoint parses
    previous: str | None = None  # the previous_response_id the client gave
    kept: bool = field(default=False)  # the record was written


class Responses:
    def __init__(self, store: Store, inflight, aborts, siblings,
                 registry: CollectorRegistry | None, renew_every: float = RENEW_EVERY) -> None:
        self.store = store
        self.inflight = inflight  # dispatch/inflight.py: the requests running here
        self.aborts = aborts
        self.siblings = siblings  # the other --workers processes
        self.running: dict[str, Turn] = {}  # response id -> the turn, running here
        self.renew_every = renew_every
        self._renewer: asyncio.Task | None = None
        self.errors = Counter("gateway_responses_store_errors",
                              "Response store operations that failed, by operation",
                              ["operation"], registry=registry)
        self._saving: set[asyncio.Task] = set()  # final saves behind the answer (`keep`)
        self.pending: dict[str, tuple[Turn, dict, float]] = {}  # turns ended here whose final
        # save the store refused, with their final response and when it is given up: their
        # leases are renewed until it is kept, and a reader finds them finished (`settle`)
        self._retrier: asyncio.Task | None = None  # tries them again (`_save_pending`)
        self._back = asyncio.Event()  # set by a write that succeeded: the store is back

    async def start(self) -> None:
        self.store.on_cancel(self._cancel_here)
        if self.siblings is not None:
            self.siblings.on_settle(self.settle)
        self._renewer = asyncio.get_running_loop().create_task(
            self._renew(), name="responses-leases")
        try:
            await self.store.start()
        except StoreDown as exc:  # served anyway; turns that need history get 503
            self.errors.labels("start").inc()
            log.warning("%s", exc.detail)

    async def stop(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            await asyncio.gather(self._renewer, return_exceptions=True)
        for task in list(self._saving):
            task.cancel()
        await asyncio.gather(*self._saving, return_exceptions=True)
        await self.store.close()

    def end(self, turn: Turn) -> None:
        self.running.pop(turn.rid, None)

    async def _renew(self) -> None:
        """Every `renew_every` s, renew the leases of the kept turns running here, in one
        write; a store that refused it is tried at the next period (the lease outlasts two)."""
        while True:
            await asyncio.sleep(self.renew_every)
            turns = (*self.running.values(), *(p[0] for p in self.pending.values()))
            keys = [(t.tenant, t.rid) for t in turns if t.kept]
            if not keys:
                continue
            try:
                await self.store.renew(keys)
            except StoreDown as exc:
                self.errors.labels("renew").inc()
                log.warning("responses: %d leases not renewed: %s", len(keys), exc.detail)
            else:
                self._back.set()

    async def read(self, tenant: str, rid: str, operation: str) -> dict | None:
        """The record of `rid` for `tenant` (None: none, or deleted), as it stands: an
        in_progress one whose lease lapsed reads as failed (its process stopped). One whose
        final save is pending (here or in a sibling worker) is written first, so a client that
        got the whole answer can continue it (it read in_progress: 400) as soon as the store
        takes writes again. StoreDown passes up (503, Retry-After)."""
        try:
            record = await self._get(tenant, rid)
            if record is None or record.get("status") != "in_progress" or rid in self.running:
                return record
            if await self._settled(tenant, rid):
                return await self._get(tenant, rid)  # finished now
            if await self.store.leased(tenant, rid):
                return record
            record = await self._get(tenant, rid)  # it may have finished meanwhile (a
            # final save ends the lease with the in_progress record, in one write)
        except StoreDown:
            self.errors.labels(operation).inc()
            raise
        if record is not None and record.get("status") == "in_progress":
            return history.stopped(record)
        return record

    async def _get(self, tenant: str, rid: str) -> dict | None:
        """The stored record, None when there is none or only its tombstone."""
        raw = await self.store.get(tenant, rid)
        record = None if raw is None else history.parse_record(raw)
        return None if record is None or record.get("status") == DELETED else record

    async def keep(self, turn: Turn, response: dict, operation: str = "save") -> str | None:
        """Write the turn's record; a failure is logged and counted, never the client's. A
        final save that failed is tried again while the store recovers (`_save_pending`).
        The status the record holds now (None: not kept): a final save that a cancel came
        before says `cancelled`, and so does `response` then (what the client is sent).

        A turn whose start the store refused is not held for its final save: no record of it
        is there for a cancel to race, and a store that refused it (a file locked, a Redis not
        answering) would cost the client a second deadline. It is tried behind the answer."""
        if operation == "save" and not turn.kept:
            self._behind(self._try(turn, response, operation))
            return None
        return await self._try(turn, response, operation)

    async def _try(self, turn: Turn, response: dict, operation: str) -> str | None:
        try:
            status = await self._write(turn, response, operation)
        except StoreDown as exc:
            self.errors.labels(operation).inc()
            log.warning("response %s not kept: %s", turn.rid, exc.detail)
            if operation == "save":  # its placeholder says in_progress (when the store
                # refused its start, it may have been written all the same: a Redis reply
                # that timed out)
                self.pending[turn.rid] = (turn, response, time.monotonic() + SAVE_FOR)
                if self._retrier is None or self._retrier.done():
                    self._retrier = self._behind(self._save_pending())
            return None
        self._back.set()
        return status

    def _behind(self, work) -> asyncio.Task:
        """Run a write after the answer; `stop` ends those still running."""
        task = asyncio.get_running_loop().create_task(work)
        self._saving.add(task)
        task.add_done_callback(self._saving.discard)
        return task

    async def _write(self, turn: Turn, response: dict, operation: str) -> str | None:
        if operation == "save":
            return await self._finish(turn, response)
        await self.store.put(turn.tenant, turn.rid, history.record_of(response, turn.items),
                             leased=True)
        turn.kept = True
        return response.get("status")

    async def _finish(self, turn: Turn, response: dict) -> str | None:
        """The final save. It and a cancel each change the in_progress record, atomically:
        the first wins, and the other finds the record finished. A record that is gone was
        lost, not deleted (a delete leaves a tombstone): it is written again, or the client
        had the whole answer and GET and the next turn got 404 (a byte limit once evicted
        a long turn's running record)."""
        record = history.record_of(response, turn.items)
        for expected in ("in_progress", None):
            if await self.store.swap(turn.tenant, turn.rid, expected, record):
                if expected is None and turn.kept:
                    log.warning("response %s: its running record was gone; written again",
                                turn.rid)
                turn.kept = True
                return response.get("status")
            current = await self.store.get(turn.tenant, turn.rid)
            if current is not None:
                break
        else:
            return None
        status = history.parse_record(current).get("status")
        if status == DELETED:  # deleted while it ran: it stays deleted, its mark goes
            await self.store.delete(turn.tenant, turn.rid, tombstone=False)
            return None
        if status == "cancelled":  # a cancel came first: what was made is kept, cancelled
            response["status"] = "cancelled"
            await self.store.swap(turn.tenant, turn.rid, "cancelled",
                                  history.record_of(response, turn.items))
        return status

    async def _save_pending(self) -> None:
        """Try the pending final saves again, oldest first, in rounds, until none is left:
        their records say in_progress meanwhile, and no next turn may follow them. A round
        stops at the first refusal (one failed write per round while the store is down,
        however many wait); rounds come after SAVE_AGAIN's gaps, or once a write here
        succeeded, so a record is kept within 5 s of the store's return (it took 30 s)."""
        for round_ in itertools.count():
            if not self.pending:
                return
            gap, began = SAVE_AGAIN[min(round_, len(SAVE_AGAIN) - 1)], time.monotonic()
            self._back.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._back.wait(), gap)
            await asyncio.sleep(began + min(gap, WAKE_GAP) - time.monotonic())
            for rid, (turn, response, _) in list(self.pending.items()):
                if rid not in self.pending:
                    continue  # settled meanwhile
                try:
                    await self._write(turn, response, "save")
                except StoreDown:
                    self.errors.labels("save").inc()
                    self._give_up(time.monotonic())
                    break
                self.pending.pop(rid, None)
                log.warning("response %s kept after all", rid)

    def _give_up(self, now: float) -> None:
        """Drop the pending saves tried for SAVE_FOR: their records read failed once their
        leases lapse (they are renewed no more)."""
        for rid, (_, _, until) in list(self.pending.items()):
            if now >= until:
                del self.pending[rid]
                log.error("response %s not kept: the store did not recover within %gs; its "
                          "record reads failed once its lease lapses", rid, SAVE_FOR)

    async def settle(self, rid: str, tenant: str) -> bool:
        """Write now the final save of `rid` pending here (a turn that finished while the
        store was down): True when there was one. A reader (GET, a next turn, a cancel) asks
        it first, here and in the sibling workers, so a response its client got whole is not
        read in_progress, nor made cancelled after it (StoreDown passes up: 503, not let
        win)."""
        pending = self.pending.get(rid)
        if pending is None or pending[0].tenant != tenant:
            return False
        turn, response, _ = pending
        await self._write(turn, response, "save")
        if self.pending.get(rid) is pending:
            del self.pending[rid]
        log.warning("response %s kept after all, before a reader", rid)
        return True

    async def cancel(self, tenant: str, rid: str) -> dict | None:
        """Cancel `rid` of `tenant`: its record says cancelled, and its legs are aborted
        wherever it runs. The response as it now stands, or None when there is none. A
        response that finished first (its final save won the record) is returned as it is."""
        record = await self.read(tenant, rid, "cancel")
        if record is None:
            running = self.running.get(rid)
            if running is None or running.tenant != tenant:
                return None
            await self.abort(rid)  # running, not stored (store=false)
            return {"id": rid, "object": "response", "status": "cancelled", "output": []}
        response = record["response"]  # a pending final save was written by the read
        if record.get("status") not in history.TERMINAL:
            response["status"] = "cancelled"
            try:
                won = await self.store.swap(tenant, rid, "in_progress", history.record_of(
                    response, record.get("input") or [], "cancelled"))
            except StoreDown:
                self.errors.labels("cancel").inc()
                raise
            if won:
                await self.abort(rid)
                return response
            record = await self.read(tenant, rid, "cancel")  # it finished meanwhile
            if record is None:
                return None
            response = record["response"]
        response["status"] = record.get("status") or response.get("status")
        return response  # finished: a cancel changes nothing (as SGLang's)

    async def _settled(self, tenant: str, rid: str) -> bool:
        """A final save of `rid` pending here or in a sibling worker was written now
        (StoreDown, or ServiceUnavailable from a sibling, when the store refused it again)."""
        return await self.settle(rid, tenant) or (
            self.siblings is not None and await self.siblings.settle(rid, tenant))

    async def abort(self, rid: str) -> None:
        """Abort the legs of `rid`: here, in a sibling worker, or in another replica."""
        if await self._cancel_here(rid):
            return
        found = await self.siblings.abort(rid, "", True)
        if found is None:
            await self.store.announce_cancel(rid)

    async def _cancel_here(self, rid: str) -> bool:
        tracked = self.inflight.find(rid) if rid in self.running else None
        if tracked is None:
            return False
        await self.aborts.abort(tracked)
        return True


def build_store(config, worker) -> Store:
    """The configured store: redis:// (shared), a file path (SQLite), else memory, or with
    `--workers` a SQLite file in the processes' shared work directory."""
    retention = Retention(config.responses_ttl, config.responses_max_count,
                          config.responses_max_bytes)
    where = config.responses_store
    if where and where.startswith(("redis://", "rediss://", "unix://")):
        from gateway.responses.redis_store import RedisStore  # noqa: PLC0415 - when chosen

        return RedisStore(where, retention)
    if not where and worker is not None:
        where = os.path.join(os.path.dirname(worker.shared.lock_path), "responses.sqlite3")
    return SQLiteStore(where or None, retention)


def build_responses(gw) -> Responses:
    """The process's Responses state, from the gateway's parts (runtime.Gateway)."""
    return Responses(build_store(gw.config, gw.worker), gw.inflight, gw.aborts, gw.siblings,
                     None if gw.worker is not None else gw.registry)
