"""Bootstrap room allocation: unique for the life of the process and across replicas.

A room is 63 bits: the replica id (12 bits, 0..4095) in bits 51..62 and a 51-bit counter
below. The counter starts at the current time in microseconds and only increases, so:

* within one process rooms never repeat (a retry takes fresh rooms);
* two replicas with different ids can never produce the same room;
* a restarted gateway starts above every room it handed out before, as long as it allocated
  fewer than one million rooms per second on average over its life (the counter cannot pass
  the clock faster than that), so a prefill's tombstone of an old room is never hit;
* a room can be asked for in a residue class: `take(count, modulus=ranks, residue=rank)`
  returns rooms with `room % ranks == rank`, which is how a prefill following bootstrap
  rooms (`follow_bootstrap_room_scheduler`) and its decode (`_resolve_prefill_dp_rank`) find
  the DP rank the gateway chose. Skipping to the residue costs at most `ranks - 1` counter
  values per request, so the restart argument holds below 1e6 / ranks rooms a second.

The counter wraps after 2**51 (about the year 2041 in microseconds) within its own bits.
"""

from __future__ import annotations

import secrets
import time

REPLICA_BITS = 12
COUNTER_BITS = 51
MAX_REPLICA = (1 << REPLICA_BITS) - 1


WORKER_BITS = 5  # with --workers: up to 32 worker processes, each with its own rooms


class RoomAllocator:
    """Rooms of one gateway process. A worker of `--workers N` puts its id in the 5 bits
    under the replica id, so its counter has 46 bits (2.2 years of microseconds before it
    wraps within its own bits) and no two workers or replicas can make the same room."""

    def __init__(self, replica_id: int | None = None, start: int | None = None,
                 worker_id: int | None = None) -> None:
        if replica_id is None:
            replica_id = secrets.randbelow(MAX_REPLICA + 1)
        if not 0 <= replica_id <= MAX_REPLICA:
            raise ValueError(f"replica id must be in 0..{MAX_REPLICA}")
        self.replica_id = replica_id
        self.worker_id = worker_id
        counter_bits = COUNTER_BITS
        self._base = replica_id << COUNTER_BITS
        if worker_id is not None:
            if not 0 <= worker_id < (1 << WORKER_BITS):
                raise ValueError(f"worker id must be in 0..{(1 << WORKER_BITS) - 1}")
            counter_bits = COUNTER_BITS - WORKER_BITS
            self._base |= worker_id << counter_bits
        self._mask = (1 << counter_bits) - 1
        self._next = (time.time_ns() // 1000 if start is None else start) & self._mask

    def take(self, count: int | None = None, modulus: int = 1,
             residue: int = 0) -> int | list[int]:
        """One room (count None) or a list of `count` distinct rooms, each with
        `room % modulus == residue`."""
        if modulus <= 1:
            if count is None:
                room = self._base | self._next
                self._next = (self._next + 1) & self._mask
                return room
            first = self._next
            self._next = (first + count) & self._mask
            return [self._base | ((first + i) & self._mask) for i in range(count)]
        rooms = [self._in_class(modulus, residue) for _ in range(count or 1)]
        return rooms[0] if count is None else rooms

    def _in_class(self, modulus: int, residue: int) -> int:
        """The next room at or above the counter with room % modulus == residue."""
        while True:
            room = self._base | self._next
            self._next = (self._next + (residue - room) % modulus) & self._mask
            room = self._base | self._next
            self._next = (self._next + 1) & self._mask
            if room % modulus == residue:  # false only when the counter wrapped just now
                return room
