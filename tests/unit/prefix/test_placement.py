"""Ring order and anchors: what every process computes alike, without sharing state."""

from __future__ import annotations

import random

import pytest

from gateway.prefix.placement import Ring, anchor_of
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
    assert r.first(anchor, candidates, loads, 0.25, among) == expect


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
