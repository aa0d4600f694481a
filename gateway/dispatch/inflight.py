"""Requests in flight, by the ids their callers know, so that callers can abort their own.

Each inference request is registered under its request id (`x-request-id`) and the client's
own rids, with its owner (the caller's API key; `anonymous@<address>` without keys) and the
attempts now running on servers; the random rids the gateway made for an attempt (SGLang's
`meta_info.id`) are found through the attempts.

Aborting (`POST /abort_request`) goes through this table, never straight to the servers: a
caller reaches only requests it owns (an admin reaches any), and the gateway forwards to the
two servers of each running attempt exactly `{"rid": <upstream rid>}`. SGLang's scheduler
aborts every request whose rid STARTS WITH the given one (`Scheduler.abort_request`), so a rid
is forwarded only when no other request in flight has a rid it is a prefix of; gateway-made
rids (32 random hex digits) always qualify. Otherwise the request is stopped by closing its
upstream connections, which SGLang also treats as an abort.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from gateway.errors import BadRequest

MAX_ID_LENGTH = 128
SAFE_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


class RandomIds:
    """Random ids nobody can guess (128 bits each): request ids and rids the gateway makes.

    Read from the OS 128 ids at a time (a read per id was 2% of a request's CPU); the
    buffer is dropped in a forked child, so two processes never hand out the same ids."""

    BATCH = 128

    def __init__(self) -> None:
        self._hex = ""
        self._at = 0

    def __call__(self) -> str:
        at = self._at
        if at >= len(self._hex):
            self._hex, at = os.urandom(16 * self.BATCH).hex(), 0
        self._at = at + 32
        return self._hex[at:at + 32]

    def reset(self) -> None:
        self._hex, self._at = "", 0


new_id = RandomIds()
os.register_at_fork(after_in_child=new_id.reset)


def safe_id(value: str | None) -> bool:
    return value is not None and SAFE_ID.fullmatch(value) is not None


def client_rids(rid: object, items: int | None) -> tuple[str, ...] | None:
    """Validate a client's `rid` (a string, or for a batch a list of distinct strings)."""
    if rid is None:
        return None
    if isinstance(rid, str):
        if not safe_id(rid):
            raise BadRequest("'rid' must be 1-128 characters of A-Z a-z 0-9 . _ : -")
        return (rid,)
    if isinstance(rid, list) and items is not None and len(rid) == items:
        if not all(isinstance(r, str) and safe_id(r) for r in rid) or len(set(rid)) != len(rid):
            raise BadRequest("'rid' list entries must be distinct ids of 1-128 characters of "
                             "A-Z a-z 0-9 . _ : -")
        return tuple(rid)
    raise BadRequest("'rid' must be a string, or a list with one id per prompt")


@dataclass(eq=False, slots=True)
class Tracked:
    """One inference request as the abort endpoint sees it."""

    request_id: str
    owner: str
    rids: tuple[str, ...] = ()  # the client's own rids, if it gave any
    attempts: set = field(default_factory=set)  # pd.Attempt objects running now
    aborted: bool = False
    interrupt: object | None = None  # cancel.Interrupt of the request's task
    trace: object | None = None  # tracing.RequestTrace with tracing on, else None
    usage: object | None = None  # usage.RequestUsage: its figures (None for the gateway's own)
    not_after: float | None = None  # the client's own deadline (loop time), if it sent one
    # attempts of this request that failed after waiting (health/deadlines.py: `urgency`)
    silences: int = 0
    # the error a begun stream ended with, its event already sent: the request counts with
    # its status, not the 200 of its head (routes/inference.py)
    failure: object | None = None

    def keys(self) -> tuple[str, ...]:
        return (self.request_id, *self.rids)


class InFlight:
    """The table of requests in flight (one per gateway process).

    Client-chosen ids (`x-request-id`, `rid`) are not unique: two callers, or one caller
    twice, may hold the same id at once. A key's first holder is in `_by_key` (the only dict
    work for the common, unique case); later holders of a held key wait in `_more`, so an
    abort can look among one owner's requests and no one's id hides another's."""

    def __init__(self) -> None:
        self._by_key: dict[str, Tracked] = {}  # key -> its first holder in flight
        self._more: dict[str, list[Tracked]] = {}  # key -> its later holders (rare)

    def __len__(self) -> int:
        return len(self._tracked())

    def add(self, tracked: Tracked) -> None:
        """Register under every id; an id already held keeps its holder and gets another."""
        table = self._by_key
        if not tracked.rids:  # most requests: their id alone, no tuple of keys to build
            key = tracked.request_id
            if table.setdefault(key, tracked) is not tracked:
                self._more.setdefault(key, []).append(tracked)
            return
        for key in tracked.keys():
            held = table.setdefault(key, tracked)
            if held is not tracked:
                more = self._more.setdefault(key, [])
                if tracked not in more:  # its x-request-id may also be one of its rids
                    more.append(tracked)

    def remove(self, tracked: Tracked) -> None:
        table = self._by_key
        if not tracked.rids and not self._more:  # nothing shared: its own key alone
            key = tracked.request_id
            if table.get(key) is tracked:
                del table[key]
            return
        for key in tracked.keys():
            self._drop(key, tracked)

    def _drop(self, key: str, tracked: Tracked) -> None:
        """`tracked` no longer holds `key`; its next holder, if any, becomes the first."""
        more = self._more.get(key)
        if self._by_key.get(key) is tracked:
            if more:
                self._by_key[key] = more.pop(0)
            else:
                del self._by_key[key]
        elif more and tracked in more:
            more.remove(tracked)
        if more is not None and not more:
            del self._more[key]

    def holders(self, key: str, owner: str | None = None) -> list[Tracked]:
        """Every request known by `key` (of `owner` only, if given): by request id or own
        rid, and by the upstream rid of a running attempt (SGLang's `meta_info.id`), exact."""
        found = []
        first = self._by_key.get(key)
        if first is not None:
            found = [first, *self._more.get(key, ())]
        for tracked in self._tracked():
            if tracked not in found and any(key in a.rid_list for a in tracked.attempts):
                found.append(tracked)
        return found if owner is None else [t for t in found if t.owner == owner]

    def find(self, key: str) -> Tracked | None:
        """The first request known by `key` (for ids only the gateway makes, which are
        unique; an abort by a client's id looks through `holders`): a request id is found in
        the table at once, and only an upstream rid needs the walk over every attempt."""
        first = self._by_key.get(key)
        if first is not None:
            return first
        found = self.holders(key)
        return found[0] if found else None

    def prefix_safe(self, rid: str, of: Tracked) -> bool:
        """No other request in flight has an upstream rid that starts with `rid`."""
        for tracked in self._tracked():
            if tracked is of:
                continue
            for attempt in tracked.attempts:
                if any(other.startswith(rid) for other in attempt.rid_list):
                    return False
        return True

    def _tracked(self) -> set[Tracked]:
        every = set(self._by_key.values())
        for more in self._more.values():
            every.update(more)
        return every
