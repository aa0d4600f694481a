"""Rooms: unique in a process, across replicas, across restarts, never reused on retry."""

from gateway.dispatch.bootstrap_rooms import COUNTER_BITS, RoomAllocator


def test_rooms_unique_over_100k_and_in_range():
    alloc = RoomAllocator(replica_id=7)
    rooms = [alloc.take() for _ in range(50_000)]
    for _ in range(10_000):
        rooms.extend(alloc.take(5))
    assert len(rooms) == 100_000
    assert len(set(rooms)) == len(rooms)
    assert all(0 <= r < 2**63 for r in rooms)
    assert {r >> COUNTER_BITS for r in rooms}  # the replica id == {7}


def test_replicas_never_collide_even_with_same_clock():
    a = RoomAllocator(replica_id=1, start=1000)
    b = RoomAllocator(replica_id=2, start=1000)
    rooms_a = {a.take() for _ in range(1000)}
    rooms_b = {b.take() for _ in range(1000)}
    assert not rooms_a & rooms_b


def test_restart_starts_above_previous_rooms():
    # the counter starts at the clock in microseconds: 1000 rooms handed out in 1 ms are all
    # below where a process restarted 1 ms later begins
    t0 = 1_764_000_000_000_000
    first = RoomAllocator(replica_id=3, start=t0)
    before = [first.take() for _ in range(1000)]
    second = RoomAllocator(replica_id=3, start=t0 + 1000)
    assert second.take() > max(before)


def test_default_start_is_the_clock():
    import time

    now_us = time.time_ns() // 1000
    room = RoomAllocator(replica_id=0).take()
    assert now_us <= room <= now_us + 10_000_000


def test_batch_rooms_are_consecutive_and_skip_ahead():
    alloc = RoomAllocator(replica_id=0, start=10)
    assert alloc.take(3) == [10, 11, 12]
    assert alloc.take() == 13


def test_counter_wraps_inside_its_bits():
    alloc = RoomAllocator(replica_id=5, start=(1 << COUNTER_BITS) - 1)
    first, second = alloc.take(), alloc.take()
    assert first >> COUNTER_BITS == second >> COUNTER_BITS == 5
    assert second == 5 << COUNTER_BITS


def test_default_replica_is_random_in_range():
    assert 0 <= RoomAllocator().replica_id < 4096
