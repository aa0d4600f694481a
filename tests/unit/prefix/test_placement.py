"""Ring order and anchors: what every process computes alike, without sharing state."""

from __future__ import annotations

import random

import pytest

from gateway.prefix.placement import VNODES, Ring, _hash, anchor_of, first, place
from tests.unit.builders import chat, server

URLS = [f"http://10.0.2.{i}:30000" for i in range(1, 6)]


def ring() -> Ring:
    r = Ring()
    r.rebuild(URLS)
    return r


@pytest.mark.parametrize(
    ("among", "loaded", "expect"),
    [
        pytest.param([True] * 5, None, 0, id="first_on_the_ring"),
        pytest.param([False, True, True, True, True], None, 1, id="skips_those_not_among"),
        pytest.param([True] * 5, 0, 1, id="skips_one_over_the_bound"),
        pytest.param([True, False, False, False, False], 0, None, id="none_within_the_bound"),
    ],
)
def test_first_follows_the_ring_within_the_bound(among, loaded, expect) -> None:
    r = ring()
    anchor = b"some prompt"
    order = r.walk(anchor)
    candidates = [server(url) for url in order]  # candidate i is the i-th on the ring
    loads = [0.0] * 5
    if loaded is not None:
        loads[loaded] = 50.0  # far over (1 + 0.25) x the average + 1
    assert first(r.order(anchor, candidates), loads, 0.25, among) == expect


def test_order_is_the_walk_as_candidate_indices() -> None:
    """Candidates come in any order, some may be missing from the ring (just added): the
    order lists the ring's members among them, by their index, clockwise from the anchor."""
    r = ring()
    anchor = b"another prompt"
    walk = r.walk(anchor)
    candidates = [server(url) for url in [URLS[3], "http://10.0.9.9:1", URLS[0], URLS[4]]]
    order = r.order(anchor, candidates)
    assert [candidates[i].url for i in order] == [url for url in walk
                                                  if url in {URLS[0], URLS[3], URLS[4]}]
    assert place(order, [0.0] * 4, 0.25) == order[0]
    assert place([], [0.0], 0.25) is None


def test_a_kept_order_answers_only_the_same_candidates() -> None:
    """An order is kept per starting point for the candidates it was computed for: the same
    servers again (a new list) get it; fewer, others, or the same in another order get
    their own, and a rebuild forgets every kept order."""
    r = ring()
    fleet = [server(url) for url in URLS]
    for n in range(50):
        anchor = f"prompt {n}".encode()
        walk = r.walk(anchor)
        for candidates in (fleet, list(fleet), fleet[1:], fleet[::-1], fleet[:2], list(fleet)):
            order = r.order(anchor, candidates)
            assert [candidates[i].url for i in order] == \
                [url for url in walk if url in {c.url for c in candidates}]
    others = [server(url) for url in URLS]  # the same URLs, other servers (after a rebuild)
    r.rebuild(URLS[:2])
    order = r.order(b"prompt 0", others)
    assert [others[i].url for i in order] == list(r.walk(b"prompt 0"))


def test_place_prefers_room_then_the_first_within_the_bound_then_the_first() -> None:
    order = [2, 0, 1]
    assert place(order, [0.0, 0.0, 0.0], 0.25, [True, True, False]) == 0  # 2 has no room
    assert place(order, [0.0, 9.0, 9.0], 0.25, [False, True, True]) == 0  # in bound, no room
    assert place(order, [9.0, 9.0, 90.0], 0.25) == 0  # 2 over the bound
    assert place([2], [9.0, 9.0, 90.0], 0.25) == 2  # nobody in bound: the first


def test_anchors_are_shared_by_a_long_system_prompt_and_kept_over_turns() -> None:
    rng = random.Random(7)
    long_system = " ".join(f"w{rng.randrange(1000)}" for _ in range(800))  # > 2,048 chars
    short_system = "Be brief."
    for system, shared in ((long_system, True), (short_system, False)):
        anchors = set()
        for n in range(5):
            first = [("system", system), ("user", f"question {n}? " * 3)]
            turns = [first, [*first, ("assistant", "an answer"), ("user", "and then?")]]
            keys = {anchor_of(chat(*messages).routing_key) for messages in turns}
            assert len(keys) == 1  # the conversation keeps its anchor
            anchors |= keys
        assert (len(anchors) == 1) is shared  # a long prompt anchors all its conversations


def _walk_by_hand(keys: list[str], anchor: bytes) -> tuple[str, ...]:
    """The ring walked afresh from its definition: VNODES points per target, every target
    once, clockwise from the first point after the anchor's."""
    ring_points = sorted((_hash(f"{key}#{v}".encode()), key) for key in keys
                         for v in range(VNODES))
    start = sum(point <= _hash(anchor) for point, _ in ring_points) % len(ring_points)
    order: list[str] = []
    for i in range(len(ring_points)):
        owner = ring_points[(start + i) % len(ring_points)][1]
        if owner not in order:
            order.append(owner)
    return tuple(order)


def test_kept_walks_are_the_walks_and_a_rebuild_forgets_them() -> None:
    """A walk is kept by its starting point: asked again (the pick asks two or three times),
    or for another anchor starting at the same point, it is the same order as a fresh walk;
    after the servers change, no walk of the old ring is given out."""
    r = ring()
    anchors = [f"prompt {n}".encode() for n in range(300)]
    for _ in range(2):  # the second pass is served from what the first kept
        for anchor in anchors:
            assert r.walk(anchor) == _walk_by_hand(URLS, anchor)
    fewer = URLS[:3] + ["http://10.0.2.9:30000"]
    r.rebuild(fewer)
    for anchor in anchors:
        assert r.walk(anchor) == _walk_by_hand(fewer, anchor)
        assert set(r.walk(anchor)) == set(fewer)


def test_kept_walks_are_bounded(monkeypatch) -> None:
    from gateway.prefix import placement

    monkeypatch.setattr(placement, "WALKS", 8)
    r = ring()
    for n in range(200):
        assert len(r.walk(f"prompt {n}".encode())) == len(URLS)
    assert len(r._walks) == 8
