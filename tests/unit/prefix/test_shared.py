"""The table where worker processes record where they sent prompts (policies/shared_prefixes.py),
and cache_aware reading it: a conversation's next turn finds the server of its previous turn,
whichever process routed that."""

from __future__ import annotations

import time
from collections import deque

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.policies import create_policy
from gateway.prefix.shared import (
    BLOCK,
    SCAN,
    WORDS,
    SharedPrefixes,
    merged,
)
from gateway.prefix.tree import Match
from gateway.processes.shared_state import SharedState
from gateway.request import CHAT, RequestView, parse_request
from gateway.servers.pool import Server

A, B, C = "http://10.0.0.1:30000", "http://10.0.0.2:30000", "http://10.0.0.3:30000"


def table() -> SharedPrefixes:
    return SharedPrefixes(memoryview(bytearray(8 * WORDS)).cast("q"))


def test_a_continuation_finds_where_its_earlier_prompt_went_in_another_process(tmp_path):
    """Two attachments of one real shared block, as two worker processes have."""
    name = f"pdgw-test-{time.monotonic_ns()}"
    mine = SharedState(name, 2, 0, str(tmp_path / "lock"), create=True)
    theirs = SharedState(name, 2, 0, str(tmp_path / "lock"))
    try:
        turn1 = "system: be brief\nuser: " + "tell me about ports " * 100  # 2,000+ chars
        now = time.monotonic()
        theirs.prefixes.record(turn1, B, now)
        turn2 = turn1 + "\nassistant: ports are numbers\nuser: more?"
        found = mine.prefixes.find(turn2, [A, B, C], now + 1.0)
        assert found is not None
        target, length, when = found
        assert target == B
        assert length == len(turn1) - len(turn1) % BLOCK  # the longest block-aligned prefix
        assert turn2[:length] == turn1[:length]
        assert abs(when - now) <= 0.1  # deciseconds
    finally:
        theirs.close()
        mine.close(unlink=True)


def test_only_candidate_targets_are_found():
    prefixes = table()
    key = "q" * (4 * BLOCK)
    prefixes.record(key, B, 100.0)
    assert prefixes.find(key + "x", [A, C], 101.0) is None
    assert prefixes.find(key + "x", [A, B], 101.0)[0] == B


def test_a_prompt_shorter_than_a_block_is_not_recorded():
    prefixes = table()
    prefixes.record("short", A, 1.0)
    assert prefixes.find("short and then more" * 40, [A], 2.0) is None
    assert not any(prefixes.words)


def test_the_lookup_reaches_back_scan_blocks_and_no_further():
    prefixes = table()
    earlier = "e" * (3 * BLOCK)
    prefixes.record(earlier, A, 5.0)
    near = earlier + "n" * ((SCAN - 1) * BLOCK)  # the earlier prompt is its SCAN-th prefix
    far = earlier + "f" * (SCAN * BLOCK)
    assert prefixes.find(near, [A], 6.0)[1] == len(earlier)
    assert prefixes.find(far, [A], 6.0) is None


def test_what_the_tree_already_knows_stops_the_lookup():
    prefixes = table()
    earlier = "k" * (2 * BLOCK)
    prefixes.record(earlier, A, 5.0)
    later = earlier + "z" * BLOCK
    assert prefixes.find(later, [A], 6.0, known=2 * BLOCK) is None
    assert prefixes.find(later, [A], 6.0, known=2 * BLOCK - 1)[1] == 2 * BLOCK


def test_token_keys_count_tokens_and_text_counts_characters():
    prefixes = table()
    tokens = tuple(range(1000, 1000 + 3 * BLOCK // 4))  # 3 blocks of 4-byte ids
    prefixes.record(tokens, A, 1.0)
    assert prefixes.find((*tokens, 7, 8), [A], 2.0)[1] == len(tokens)
    text = "é" * (2 * BLOCK)  # two bytes a character: 4 blocks
    prefixes.record(text, B, 1.0)
    target, length, _ = prefixes.find(text + "!", [B], 2.0)
    assert (target, length) == (B, len(text))


def test_a_full_bucket_gives_up_its_oldest_entry():
    prefixes = table()
    prefixes._mask = 0  # every tag in one bucket
    keys = [chr(ord("a") + i) * BLOCK for i in range(5)]
    for when, key in enumerate(keys):
        prefixes.record(key, A, 10.0 + when)
    assert prefixes.find(keys[0], [A], 20.0) is None  # the oldest went
    assert all(prefixes.find(k, [A], 20.0) is not None for k in keys[1:])
    prefixes.record(keys[1], B, 30.0)  # the same prefix again: its entry, not a new one
    assert prefixes.find(keys[1], [A, B], 31.0)[0] == B
    assert prefixes.find(keys[2], [A], 31.0) is not None


def test_times_survive_the_wrap_of_the_stored_clock():
    prefixes = table()
    key = "w" * BLOCK
    start = (1 << 31) / 10 - 0.5  # half a second before the deciseconds wrap
    prefixes.record(key, A, start)
    _, _, when = prefixes.find(key, [A], start + 2.0)
    assert when == pytest.approx(start, abs=0.1)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 12), st.sampled_from([A, B, C])), min_size=1,
                max_size=30))
def test_the_latest_target_of_a_recent_prompt_is_found(records):
    """Property: with few entries (no bucket full), every recorded prefix is found with the
    target it was last sent to, and a key extended by less than a block finds the same."""
    prefixes = table()
    last: dict[int, str] = {}
    for when, (blocks, target) in enumerate(records):
        prefixes.record("p" * (blocks * BLOCK), target, 100.0 + when)
        last[blocks] = target
    for blocks, target in last.items():
        found = prefixes.find("p" * (blocks * BLOCK) + "-", [A, B, C], 200.0, known=0)
        assert found is not None
        # the longest recorded prefix within SCAN blocks of this key wins: here, itself
        assert found[:2] == (target, blocks * BLOCK)


def test_merged_adds_the_other_process_knowledge_as_a_continuation():
    matched = Match({A: 300, B: 300})
    matched.end, matched.ends = 300, {A: 1.0}
    longer = merged(matched, (B, 512, 5.0))
    assert longer == {A: 300, B: 512}
    assert (longer.end, longer.ends) == (512, {B: 5.0})
    same = merged(matched, (B, 300, 5.0))
    assert (same.end, same.ends) == (300, {A: 1.0, B: 5.0})
    shorter = merged(matched, (C, 256, 5.0))
    assert shorter[C] == 256 and (shorter.end, shorter.ends) == (300, {A: 1.0})
    assert merged(matched, None) is matched


def conversation(n: int) -> list[dict]:
    system = "You are a careful assistant of the harbour authority. " * 12
    return [{"role": "system", "content": system},
            {"role": "user", "content": f"ship {n}: " + "when does it berth? " * 20}]


def view_of(messages: list[dict]) -> RequestView:
    return parse_request(CHAT, orjson.dumps({"messages": messages, "max_tokens": 8}))


@pytest.mark.parametrize("shared", [True, False])
def test_two_processes_policies_keep_a_conversation_on_one_server(shared):
    """Process 1 routes turn 1 (its only candidate then: the others were drained); process 2
    routes turn 2 with every server up. With the table it follows turn 1; without, it places
    the conversation by its ring, elsewhere for some conversation (the precondition)."""
    servers = [Server(url=u, role="prefill") for u in (A, B, C)]
    prefixes = table()
    moved = deque()
    for n in range(12):
        first, second = (create_policy("cache_aware", "prefill") for _ in range(2))
        for policy in (first, second):
            policy.on_servers_changed(servers)
            if shared:
                policy.share(prefixes)
        turn1 = conversation(n)
        placed = second.pick(servers, view_of(turn1))  # where the ring puts it (no history)
        home = next(s for s in servers if s is not placed)
        view1 = view_of(turn1)
        assert first.pick([home], view1) is home
        first.on_dispatch(home, view1)
        turn2 = [*turn1, {"role": "assistant", "content": "at noon " * 30},
                 {"role": "user", "content": "and the pilot?"}]
        chosen = second.pick(servers, view_of(turn2))
        if shared:
            assert chosen is home, n
        elif chosen is not home:
            moved.append(n)
    assert shared or moved  # without the table the conversation leaves its server


def test_blocks_counts_whole_blocks_of_the_keys_bytes():
    prefixes = table()
    assert prefixes.blocks("a" * (BLOCK - 1)) == 0
    assert prefixes.blocks("a" * BLOCK) == 1
    assert prefixes.blocks("é" * BLOCK) == 2  # two bytes a character
    assert prefixes.blocks(tuple(range(BLOCK // 4))) == 1  # four bytes a token id
