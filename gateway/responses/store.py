"""Where relayed responses are kept: the `Store` interface and its embedded SQLite store.

A record is one JSON object (history.Record: the response as the client got it, the whole
input it answered and its output items) under (tenant, id): a lookup under another tenant
finds nothing, so one tenant never reads, continues, deletes or cancels another's. Retention
is bounded three ways, whichever comes first: `ttl` seconds after the record was written,
`max_count` records and `max_bytes` bytes of records in all (the oldest go first).

The SQLite store runs its statements on one worker thread (sqlite3 blocks): a file on a path
(shared by the `--workers` processes of one host, WAL journal), or memory when no path is set
(this process only). A store that cannot answer raises `StoreDown`; the endpoint decides what
that costs a request (docs/RESPONSES.md, "When the store is down").

Every operation answers within `DEADLINE` seconds of being asked, as Redis's socket timeout
bounds its store: another process holding the file's write lock (a backup's `BEGIN
EXCLUSIVE`) once held every turn for the whole lock, because each queued write waited its own
5 s busy timeout after those ahead of it. Now an operation whose deadline passed while it
queued is not run, and one that runs waits for the lock only what is left of its deadline.

A record written `in_progress` holds a lease that the process serving the turn renews every
`RENEW_EVERY` seconds (`Responses`, all its turns in one write); a lease not renewed for
`LEASE` seconds tells that the process stopped (killed, out of memory, its node lost), and
the record is then read as failed (docs/RESPONSES.md, "A turn whose process stopped"). Here
the lease is a column, `renewed`: a database of an older version, without it, gains it when
opened, and its rows have none (an in_progress row of theirs reads as failed).
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from gateway.errors import ServiceUnavailable

DEADLINE = 2.0  # seconds an operation may take from its asking, its queueing included
RENEW_EVERY = 10.0  # seconds between two renewals of the running turns' leases
LEASE = 3 * RENEW_EVERY  # seconds a lease holds unrenewed: two renewals may be missed
DELETED = "deleted"  # the status of a tombstone: what a delete leaves of a running turn's record
TOMBSTONE = b'{"status":"deleted"}'  # so that turn's final save sees it was deleted (and not
# lost: a record missing at the final save is written again), in any worker or replica


class StoreDown(ServiceUnavailable):
    """The response store did not answer (503, Retry-After)."""

    def __init__(self, message: str) -> None:
        super().__init__("the response store is unavailable; retry shortly",
                         headers={"retry-after": "2"},  # why (a host, a file) is the operator's
                         detail=f"the response store is unavailable: {message}")


@dataclass(frozen=True, slots=True)
class Retention:
    """How much a store keeps: per record age, record count and total bytes."""

    ttl: float = 7 * 86400.0
    max_count: int = 100_000
    max_bytes: int = 256 * 1024 * 1024


class Store(Protocol):
    """Records by (tenant, id). Every method raises StoreDown when the backend is down."""

    async def get(self, tenant: str, rid: str) -> bytes | None: ...

    async def put(self, tenant: str, rid: str, record: bytes, leased: bool = False) -> None:
        """Write `record`; `leased`: it is a running turn's, which holds a lease from now."""

    async def renew(self, keys: list[tuple[str, str]]) -> None:
        """Renew the leases of these (tenant, id) records, in one write (kept records only)."""

    async def leased(self, tenant: str, rid: str) -> bool:
        """Whether the record's lease still holds (False: never had one, or not renewed
        within the lease). A final save or a cancel (`swap`) ends the lease."""

    async def swap(self, tenant: str, rid: str, expected: str | None, record: bytes) -> bool:
        """Write `record` only if the stored one's status is `expected` (None: only if there
        is no record), in one atomic step (True: written). A turn's final save and a cancel
        both change an in_progress record: a read, then a write, would let each overwrite the
        other."""

    async def delete(self, tenant: str, rid: str, tombstone: bool = True) -> bool:
        """Forget the record (True: there was one, not a tombstone), its lease ended. An
        in_progress record is replaced by `TOMBSTONE` (never evicted, never renewed), so its
        turn's final save knows it was deleted; `tombstone=False` removes whatever is there
        (that final save's cleanup)."""

    async def announce_cancel(self, rid: str) -> None:
        """Tell every gateway sharing the store to abort `rid` if it runs it."""

    def on_cancel(self, callback) -> None:
        """`callback(rid)` runs for every cancel announced (by any sharer)."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...


_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    tenant TEXT NOT NULL, id TEXT NOT NULL, written REAL NOT NULL, size INTEGER NOT NULL,
    record BLOB NOT NULL, renewed REAL, PRIMARY KEY (tenant, id));
CREATE INDEX IF NOT EXISTS responses_written ON responses (written);
"""

# one statement, so no writer comes between the status read and the write; a record that is
# not JSON has no status (CASE: json_extract would raise on it)
_SWAP = """
UPDATE responses SET written = ?, size = ?, record = ?, renewed = NULL
WHERE tenant = ? AND id = ? AND written > ?
  AND CASE WHEN json_valid(CAST(record AS TEXT))
      THEN json_extract(CAST(record AS TEXT), '$.status') END = ?
"""


_STATUS = ("CASE WHEN json_valid(CAST(record AS TEXT)) "
           "THEN json_extract(CAST(record AS TEXT), '$.status') END")
# a delete: an in_progress record becomes a tombstone (its lease ended); else it goes, unless
# it is a tombstone already (deleted, its turn still running)
_BURY = ("UPDATE responses SET record = ?, size = ?, renewed = NULL "
         f"WHERE tenant = ? AND id = ? AND {_STATUS} = ?")
_DELETE = f"DELETE FROM responses WHERE tenant = ? AND id = ? AND {_STATUS} IS NOT ?"


def _add_lease_column(db: sqlite3.Connection) -> None:
    """A database written by a version without leases gains their column (its rows none)."""
    if any(row[1] == "renewed" for row in db.execute("PRAGMA table_info(responses)")):
        return
    try:
        db.execute("ALTER TABLE responses ADD COLUMN renewed REAL")
    except sqlite3.OperationalError as exc:  # a sibling worker added it first
        if "duplicate column" not in str(exc):
            raise


class SQLiteStore:
    """The embedded store: a SQLite file at `path`, or memory when `path` is None."""

    def __init__(self, path: str | None, retention: Retention,
                 deadline: float = DEADLINE, lease: float = LEASE) -> None:
        self.path = path
        self.retention = retention
        self.deadline = deadline
        self.lease = lease
        self._db: sqlite3.Connection | None = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="responses-store")

    async def _run(self, fn, *args):
        """`fn(db, *args)` on the store's thread, within `deadline` of now (else StoreDown)."""
        by = time.monotonic() + self.deadline
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._thread, self._in_time, by, fn, args)
        except sqlite3.Error as exc:
            raise StoreDown(f"sqlite: {exc}") from None

    def _in_time(self, by: float, fn, args: tuple):
        """On the store's thread: `fn` only if its deadline has not passed while it queued,
        and its wait for the file's lock cut at that deadline. The wait never grows with the
        queue: those ahead of it ran within their own, earlier, deadlines."""
        left = by - time.monotonic()
        if left <= 0:
            raise StoreDown(f"no answer within {self.deadline:g}s (the file is locked or busy)")
        return fn(self._open(left), *args)

    def _open(self, wait: float) -> sqlite3.Connection:
        """The connection, told to wait `wait` seconds at most for a lock."""
        if self._db is not None:
            self._db.execute(f"PRAGMA busy_timeout = {max(1, int(wait * 1000))}")
            return self._db
        db = sqlite3.connect(self.path or ":memory:", timeout=wait,
                             check_same_thread=False, isolation_level=None)
        try:
            if self.path:
                db.execute("PRAGMA journal_mode=WAL")
            db.executescript(_SCHEMA)
            _add_lease_column(db)
        except BaseException:
            db.close()  # opened again by the next operation
            raise
        self._db = db
        return db

    async def start(self) -> None:
        await self._run(lambda db: None)

    async def close(self) -> None:
        def shut() -> None:
            if self._db is not None:
                self._db.close()
                self._db = None
        try:
            await asyncio.get_running_loop().run_in_executor(self._thread, shut)
        except sqlite3.Error as exc:
            raise StoreDown(f"sqlite: {exc}") from None
        finally:
            self._thread.shutdown(wait=False)

    async def get(self, tenant: str, rid: str) -> bytes | None:
        return await self._run(self._get, tenant, rid)

    def _get(self, db: sqlite3.Connection, tenant: str, rid: str) -> bytes | None:
        row = db.execute(
            "SELECT record FROM responses WHERE tenant = ? AND id = ? AND written > ?",
            (tenant, rid, time.time() - self.retention.ttl)).fetchone()
        return bytes(row[0]) if row else None

    async def put(self, tenant: str, rid: str, record: bytes, leased: bool = False) -> None:
        await self._run(self._put, tenant, rid, record, leased)

    def _put(self, db: sqlite3.Connection, tenant: str, rid: str, record: bytes,
             leased: bool) -> None:
        def insert(db: sqlite3.Connection, now: float) -> bool:
            db.execute("INSERT OR REPLACE INTO responses (tenant, id, written, size, record, "
                       "renewed) VALUES (?, ?, ?, ?, ?, ?)",
                       (tenant, rid, now, len(record), record, now if leased else None))
            return True
        self._write(db, tenant, rid, insert)

    async def renew(self, keys: list[tuple[str, str]]) -> None:
        def renew(db: sqlite3.Connection) -> None:
            now = time.time()
            db.execute("BEGIN IMMEDIATE")
            try:
                db.executemany("UPDATE responses SET renewed = ? WHERE tenant = ? AND id = ? "
                               "AND record IS NOT ?",  # a tombstone holds no lease
                               [(now, tenant, rid, TOMBSTONE) for tenant, rid in keys])
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        await self._run(renew)

    async def leased(self, tenant: str, rid: str) -> bool:
        def renewed(db: sqlite3.Connection) -> float | None:
            row = db.execute("SELECT renewed FROM responses WHERE tenant = ? AND id = ?",
                             (tenant, rid)).fetchone()
            return row[0] if row else None
        at = await self._run(renewed)
        return at is not None and at > time.time() - self.lease

    async def swap(self, tenant: str, rid: str, expected: str | None, record: bytes) -> bool:
        return await self._run(self._swap, tenant, rid, expected, record)

    def _swap(self, db: sqlite3.Connection, tenant: str, rid: str, expected: str | None,
              record: bytes) -> bool:
        def update(db: sqlite3.Connection, now: float) -> bool:
            if expected is None:  # only where none is (one past its TTL is none)
                db.execute("DELETE FROM responses WHERE tenant = ? AND id = ? AND written <= ?",
                           (tenant, rid, now - self.retention.ttl))
                return db.execute(
                    "INSERT OR IGNORE INTO responses (tenant, id, written, size, record, "
                    "renewed) VALUES (?, ?, ?, ?, ?, NULL)",
                    (tenant, rid, now, len(record), record)).rowcount == 1
            cur = db.execute(_SWAP, (now, len(record), record, tenant, rid,
                                     now - self.retention.ttl, expected))
            return cur.rowcount == 1
        return self._write(db, tenant, rid, update)

    def _write(self, db: sqlite3.Connection, tenant: str, rid: str, change) -> bool:
        """Run `change(db, now)` and the retention bounds in one write transaction (BEGIN
        IMMEDIATE: the `--workers` sharing the file wait for each other, up to the busy
        timeout `_open` set)."""
        r = self.retention
        now = time.time()
        db.execute("BEGIN IMMEDIATE")  # a lock not had is no transaction to roll back
        try:
            written = change(db, now)
            if written:
                db.execute("DELETE FROM responses WHERE written <= ?", (now - r.ttl,))
                count, size = db.execute(
                    "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM responses").fetchone()
                if count > r.max_count or size > r.max_bytes:
                    self._evict(db, count - r.max_count, size - r.max_bytes, (tenant, rid),
                                now - self.lease)
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return written

    @staticmethod
    def _evict(db: sqlite3.Connection, extra_count: int, extra_bytes: int,
               written: tuple[str, str], lapsed: float) -> None:
        """Delete the oldest records until both limits hold, never the one just `written`
        (as Redis's script: one record over the byte bound is kept alone, not dropped with
        every other tenant's), nor a running turn's (its lease renewed after `lapsed`): its
        final save would find nothing, and a response its client got whole was lost; nor a
        tombstone (its turn's final save removes it). When only those are left, the limits
        are passed until they finish (docs/RESPONSES.md)."""
        doomed = []
        for tenant, rid, size, renewed, buried in db.execute(
                "SELECT tenant, id, size, renewed, record = ? FROM responses ORDER BY written",
                (TOMBSTONE,)):
            if extra_count <= 0 and extra_bytes <= 0:
                break
            if (tenant, rid) == written or buried or (renewed is not None and renewed > lapsed):
                continue
            doomed.append((tenant, rid))
            extra_count -= 1
            extra_bytes -= size
        db.executemany("DELETE FROM responses WHERE tenant = ? AND id = ?", doomed)

    async def delete(self, tenant: str, rid: str, tombstone: bool = True) -> bool:
        def remove(db: sqlite3.Connection) -> bool:
            key = (tenant, rid)
            if not tombstone:
                return db.execute("DELETE FROM responses WHERE tenant = ? AND id = ?",
                                  key).rowcount > 0
            if db.execute(_BURY, (TOMBSTONE, len(TOMBSTONE), *key, "in_progress")).rowcount:
                return True  # one statement: a final save cannot come between
            return db.execute(_DELETE, (*key, DELETED)).rowcount > 0
        return await self._run(remove)

    async def announce_cancel(self, rid: str) -> None:
        """One host: the `--workers` siblings are asked by the handler itself."""

    def on_cancel(self, callback) -> None:
        """Nothing to follow: no other replica shares this store."""
