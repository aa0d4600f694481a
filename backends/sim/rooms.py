"""The prefill side's bootstrap rooms: who holds a room and how it ended.

A room pairs one prefill request with one decode request. Either side may
arrive first. A room that failed (timeout, cancel, abort) stays a tombstone,
so a later prefill request with the same room fails at once, as SGLang's
KV manager does; a room used once is never handed out again.

Whoever waits on a room (the prefill leg holding it, the decode's KV channel
that joined it) adds a listener; every change calls the listeners, and a
room that ends (ready or failed) calls them one last time and drops them.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

DUPLICATE_PREFILL = "Duplicate or cancelled bootstrap room"
DUPLICATE_DECODE = "Duplicate decode bootstrap room"
_MAX_ROOMS = 100_000
_TERMINAL_TTL = 600.0


@dataclass(eq=False, slots=True)
class Room:
    room: int
    prefill_rid: str | None = None
    decode_rid: str | None = None
    state: str = "open"  # open | ready | failed
    reason: str | None = None
    kv: dict[str, Any] | None = None
    dp_rank: int = 0  # the prefill DP rank whose KV manager holds the room
    created: float = field(default_factory=time.monotonic)
    listeners: list[Callable[[Room], None]] = field(default_factory=list)

    @property
    def terminal(self) -> bool:
        return self.state != "open"

    def view(self) -> dict[str, Any]:
        return {"room": self.room, "state": self.state, "prefill_rid": self.prefill_rid,
                "decode_rid": self.decode_rid, "reason": self.reason, "dp_rank": self.dp_rank}


class RoomRegistry:
    """All rooms one prefill DP rank has heard of, oldest first."""

    def __init__(self, open_ttl: float, dp_rank: int = 0) -> None:
        self.rooms: OrderedDict[int, Room] = OrderedDict()
        self.open_ttl = open_ttl
        self.dp_rank = dp_rank
        self.reused = 0  # claims of a room a prefill or decode request already held

    def _notify(self, room: Room) -> None:
        listeners = room.listeners
        if not listeners:
            return
        if room.terminal:
            room.listeners = []  # the last change: nobody needs to hear from it again
        else:
            listeners = list(listeners)  # a listener may add or remove listeners
        for listener in listeners:
            listener(room)

    def _create(self, number: int) -> Room:
        self._sweep()
        room = Room(number, dp_rank=self.dp_rank)
        self.rooms[number] = room
        return room

    def _sweep(self) -> None:
        now = time.monotonic()
        while self.rooms:
            oldest = next(iter(self.rooms.values()))
            age = now - oldest.created
            expired = age > (_TERMINAL_TTL if oldest.terminal else self.open_ttl)
            if len(self.rooms) < _MAX_ROOMS and not expired:
                return
            self.rooms.popitem(last=False)
            if not oldest.terminal:
                oldest.state, oldest.reason = "failed", "Bootstrap room expired"
                self._notify(oldest)

    def get(self, number: int) -> Room | None:
        return self.rooms.get(number)

    def claim_prefill(self, number: int, rid: str) -> Room | str:
        """Take the prefill half of a room, or return why it is refused.

        mirrors CommonKVSender.__init__ with DeferredBootstrap.open
        (disaggregation/common/conn.py, common/bootstrap.py): a room that has an owner or a
        failed tombstone fails with "Duplicate or cancelled bootstrap room".
        """
        room = self.rooms.get(number)
        if room is None:
            room = self._create(number)
        elif room.terminal or room.prefill_rid is not None:
            self.reused += room.prefill_rid is not None  # not a tombstone: a second owner
            return DUPLICATE_PREFILL
        room.prefill_rid = rid
        self._notify(room)
        return room

    def join_decode(self, number: int, rid: str) -> Room | str | None:
        """Take the decode half of a room (the bootstrap handshake).

        Returns the room, a refusal reason, or None: the room already sent its KV to
        another decode request, so this one is accepted and never gets any. That is the
        reused room of an n > 1 request (its warm-up took the KV): on SGLang's default
        ("early") allocation policy the decode registers for the room, no sender ever
        writes to it, and it waits out SGLANG_DISAGGREGATION_WAITING_TIMEOUT.
        """
        room = self.rooms.get(number)
        if room is not None and room.decode_rid is not None:
            self.reused += 1  # a second decode request for one room
        if room is None:
            room = self._create(number)
        elif room.state == "failed":
            return room.reason or DUPLICATE_PREFILL
        elif room.state == "ready":
            return None
        elif room.decode_rid is not None:
            # mirrors CommonKVReceiver.__init__ (disaggregation/common/conn.py)
            return DUPLICATE_DECODE
        room.decode_rid = rid
        self._notify(room)
        return room

    def ready(self, room: Room, kv: dict[str, Any]) -> bool:
        """Publish the KV of a room; False if the room failed meanwhile."""
        if room.terminal:
            return False
        room.state, room.kv = "ready", kv
        self._notify(room)  # the decode's channel pushes the KV now
        room.kv = None  # tombstones stay for _TERMINAL_TTL: keep them small
        return True

    def fail(self, number: int, reason: str) -> None:
        """Mark a room failed (a tombstone if nobody held it yet)."""
        room = self.rooms.get(number)
        if room is None:
            room = self._create(number)
        if room.terminal:
            return
        room.state, room.reason = "failed", reason
        self._notify(room)

