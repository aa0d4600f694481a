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
    created: float = field(default_factory=time.monotonic)
    listeners: list[Callable[[Room], None]] = field(default_factory=list)

    @property
    def terminal(self) -> bool:
        return self.state != "open"

    def view(self) -> dict[str, Any]:
        return {"room": self.room, "state": self.state, "prefill_rid": self.prefill_rid,
                "decode_rid": self.decode_rid, "reason": self.reason}


class RoomRegistry:
    """All rooms a prefill server has heard of, oldest first."""

    def __init__(self, open_ttl: float) -> None:
        self.rooms: OrderedDict[int, Room] = OrderedDict()
        self.open_ttl = open_ttl

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
        room = Room(number)
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
        """Take the prefill half of a room, or return why it is refused."""
        room = self.rooms.get(number)
        if room is None:
            room = self._create(number)
        elif room.terminal or room.prefill_rid is not None:
            return DUPLICATE_PREFILL
        room.prefill_rid = rid
        self._notify(room)
        return room

    def join_decode(self, number: int, rid: str) -> Room | str:
        """Take the decode half of a room (the bootstrap handshake)."""
        room = self.rooms.get(number)
        if room is None:
            room = self._create(number)
        elif room.state == "failed":
            return room.reason or DUPLICATE_PREFILL
        elif room.terminal or room.decode_rid is not None:
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

