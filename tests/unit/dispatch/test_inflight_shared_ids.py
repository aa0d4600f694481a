"""The in-flight table when client-chosen ids collide: two callers (or one caller twice)
holding one `x-request-id` or `rid` are both found, each by its own owner, and removing one
leaves the other findable (until 2026-12: the first holder hid every later one)."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.dispatch.inflight import InFlight, Tracked


@dataclass(eq=False)
class Attempt:
    rid_list: list = field(default_factory=list)


def held(table: InFlight, key: str, owner: str | None = None) -> list[str]:
    return [t.owner for t in table.holders(key, owner)]


def test_a_unique_id_has_one_holder_and_leaves_no_trace():
    table = InFlight()
    alone = Tracked("0123abcd" * 4, "inference:0")
    table.add(alone)
    assert table.holders(alone.request_id) == [alone] and table.find(alone.request_id) is alone
    table.remove(alone)
    assert len(table) == 0 and table.holders(alone.request_id) == []
    assert table._by_key == {} and table._more == {}


def test_two_owners_of_one_request_id_are_each_found_by_their_own():
    table = InFlight()
    alice, bob = Tracked("job-42", "inference:0"), Tracked("job-42", "inference:1")
    table.add(alice)
    table.add(bob)
    assert len(table) == 2
    assert held(table, "job-42") == ["inference:0", "inference:1"]
    assert table.holders("job-42", "inference:1") == [bob]
    assert table.holders("job-42", "inference:0") == [alice]
    table.remove(alice)  # bob's request now holds the id alone
    assert table.holders("job-42", "inference:1") == [bob] and table.find("job-42") is bob
    table.remove(bob)
    assert table._by_key == {} and table._more == {} and len(table) == 0


def test_shared_rids_and_a_later_holder_leaving_first():
    table = InFlight()
    alice = Tracked("a" * 32, "inference:0", ("job-42", "x"))
    bob = Tracked("b" * 32, "inference:1", ("job-42",))
    bob2 = Tracked("job-42", "inference:1", ("job-42",))  # its x-request-id is its rid too
    for tracked in (alice, bob, bob2):
        table.add(tracked)
    assert table.holders("job-42", "inference:1") == [bob, bob2]
    assert table.holders("job-42") == [alice, bob, bob2]
    table.remove(bob)
    assert table.holders("job-42") == [alice, bob2]
    table.remove(bob2)
    assert table.holders("job-42") == [alice] and table.holders("x") == [alice]
    table.remove(alice)
    assert table._by_key == {} and table._more == {}


def test_an_upstream_rid_is_found_even_when_another_caller_squats_it_as_an_id():
    table = InFlight()
    alice = Tracked("a" * 32, "inference:0")
    alice.attempts.add(Attempt(rid_list=["f" * 32]))
    squatter = Tracked("f" * 32, "inference:1")  # bob's x-request-id: alice's meta_info.id
    table.add(alice)
    table.add(squatter)
    assert table.holders("f" * 32, "inference:0") == [alice]
    assert set(table.holders("f" * 32)) == {alice, squatter}


def test_prefix_safety_sees_every_holder_of_a_shared_id():
    table = InFlight()
    alice, bob = Tracked("job-42", "inference:0"), Tracked("job-42", "inference:1")
    alice.attempts.add(Attempt(rid_list=["abc-1"]))
    bob.attempts.add(Attempt(rid_list=["abc-12"]))  # only in the collision list
    table.add(alice)
    table.add(bob)
    assert not table.prefix_safe("abc-1", alice)
    assert table.prefix_safe("abc-12", bob)


class _Unread:
    """An attempt whose upstream rids must not be looked at."""

    @property
    def rid_list(self) -> list:
        raise AssertionError("find by a request id walked the other requests' attempts")


def test_find_by_a_request_id_does_not_walk_the_table():
    """A running response's cancel finds its request by id: one dict hit, however many
    requests are in flight (it walked every attempt of every request before)."""
    table = InFlight()
    for n in range(50):
        other = Tracked(f"other-{n}", "inference:0")
        other.attempts.add(_Unread())
        table.add(other)
    wanted = Tracked("resp-1", "inference:1")
    table.add(wanted)
    assert table.find("resp-1") is wanted
    up = Tracked("by-upstream", "inference:2")
    up.attempts.add(Attempt(["a" * 32]))
    plain = InFlight()
    plain.add(up)
    assert plain.find("a" * 32) is up and plain.find("b" * 32) is None
