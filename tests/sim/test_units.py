"""Pure pieces of the sim, without processes or sockets."""

from __future__ import annotations

import hashlib
import struct

import pytest

from backends.sim import tokenizer
from backends.sim.blockhash import chain_digests, digest_to_int64
from backends.sim.config import Faults, config_from_args
from backends.sim.radix import CacheEvent, RadixCache
from backends.sim.requests import BadRequest, InternalError, parse_generate


@pytest.mark.parametrize("text", ["", "abc", "abcd", "héllo wörld", "emoji 🎉 ok", "x" * 37],
                         ids=["empty", "short", "one-token", "accents", "emoji", "long"])
def test_tokenizer_round_trip(text):
    ids = tokenizer.encode(text)
    assert len(ids) == -(-len(text.encode()) // 4)
    assert tokenizer.decode(ids) == text


def test_generation_is_deterministic_and_word_sized():
    seed = tokenizer.prompt_seed([1, 2, 3])
    first = [tokenizer.output_token(seed, i) for i in range(5)]
    assert first == [tokenizer.output_token(seed, i) for i in range(5)]
    assert all(len(tokenizer.token_text(t)) == 4 for t, _ in first)
    assert tokenizer.prompt_seed([1, 2, 4]) != seed


def test_block_hash_matches_reference():
    tokens = [5, 6, 7, 8, 9]
    prior, expected = b"", []
    for t in tokens:
        prior = hashlib.sha256(prior + struct.pack("<I", t)).digest()
        expected.append(int.from_bytes(prior[:8], "big", signed=True))
    assert [digest_to_int64(d) for d in chain_digests(None, tokens, 1)] == expected


def test_radix_match_insert_split_and_events():
    events: list[CacheEvent] = []
    cache = RadixCache(page_size=1, capacity=100, record_events=True)
    cache.on_events = events.extend
    cache.insert([1, 2, 3, 4])
    assert cache.match([1, 2, 3, 4, 5]) == 4
    assert cache.match([1, 2, 3, 4]) == 3  # never the whole prompt
    cache.insert([1, 2, 9])  # splits the edge after [1, 2]
    assert cache.match([1, 2, 9, 0]) == 3 and cache.size == 5
    stored = [e for e in events if e.kind == "BlockStored"]
    assert stored[1].token_ids == [9]
    assert stored[1].parent_block_hash == stored[0].block_hashes[1]


def test_radix_lru_eviction_removes_whole_leaves():
    events: list[CacheEvent] = []
    cache = RadixCache(page_size=2, capacity=8, record_events=True)
    cache.on_events = events.extend
    cache.insert([1, 2, 3, 4])
    cache.insert([5, 6, 7, 8])
    cache.match([1, 2, 3, 4, 0])  # refresh the first
    cache.insert([9, 10])
    assert cache.size == 6 and cache.match([5, 6, 7, 8, 0]) == 0
    assert cache.match([1, 2, 3, 4, 0]) == 4
    removed = [e for e in events if e.kind == "BlockRemoved"]
    assert len(removed) == 1 and len(removed[0].block_hashes) == 2


def test_radix_zero_capacity_caches_nothing():
    cache = RadixCache(page_size=1, capacity=0)
    cache.insert([1, 2, 3])
    assert cache.size == 0 and cache.match([1, 2, 3]) == 0


def _config(*flags: str):
    return config_from_args(["--fast", *flags])


def test_rooms_expand_like_sglang():
    """obj[i] keeps room i of the normalized list; warm-up and samples all reuse it."""
    cfg = _config()
    parsed = parse_generate({"text": ["a", "b"], "bootstrap_room": 10,
                             "sampling_params": {"n": 2}}, cfg)
    assert [i.bootstrap_room for i in parsed.warmups] == [10, 11]
    assert [i.bootstrap_room for i in parsed.items] == [10, 10, 11, 11]
    parsed = parse_generate({"text": ["a", "b"], "bootstrap_room": [7, 9, 8, 6],
                             "sampling_params": {"n": 2}}, cfg)
    assert [i.bootstrap_room for i in parsed.warmups] == [7, 9]
    assert [i.bootstrap_room for i in parsed.items] == [7, 7, 9, 9]  # rooms 8 and 6 unused
    assert not parsed.is_single
    parsed = parse_generate({"text": ["a", "b"], "bootstrap_room": 5}, cfg)
    assert [i.bootstrap_room for i in parsed.items] == [5, 6] and not parsed.warmups
    # SGLang checks no list length: extra rooms are ignored, a short list is an IndexError
    parsed = parse_generate({"text": ["a"], "bootstrap_room": [1, 2]}, cfg)
    assert [i.bootstrap_room for i in parsed.items] == [1]
    with pytest.raises(InternalError):
        parse_generate({"text": ["a", "b"], "bootstrap_room": [1]}, cfg)


@pytest.mark.parametrize("body", [
    {},
    {"input_ids": []},
    {"text": ["a", "b"], "rid": ["x"]},
    {"text": "a", "sampling_params": {"max_new_tokens": -1}},
    {"text": "a", "bootstrap_room": -5},
    {"text": "a", "sampling_params": {"n": 2}, "return_logprob": [True]},
], ids=["no-prompt", "empty-ids", "rid-list-length", "negative-max-new", "negative-room",
        "logprob-list-with-n"])
def test_bad_generate_bodies(body):
    with pytest.raises(BadRequest):
        parse_generate(body, _config())


def test_config_fast_zeroes_timing_and_parses_kv_events():
    cfg = _config("--kv-events-config", '{"publisher":"zmq","endpoint":"tcp://*:5557"}')
    assert cfg.decode_step_ms == 0 and cfg.prefill_ms_per_token == 0 and cfg.token_delay == 0
    assert cfg.kv_events is not None and cfg.kv_events.enabled
    assert cfg.cache_capacity_tokens == cfg.max_total_tokens
    with pytest.raises(SystemExit):
        config_from_args(["--kv-events-config", '{"bogus": 1}'])


def test_faults_update_validates():
    faults = Faults()
    faults.update({"error-rate": 0.5, "hang": 1})
    assert faults.error_rate == 0.5 and faults.hang is True
    with pytest.raises(ValueError):
        faults.update({"error_rate": 2})
    with pytest.raises(ValueError):
        faults.update({"nope": 1})
