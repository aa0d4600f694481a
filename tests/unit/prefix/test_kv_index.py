"""The exact index: SGLang's block hashes, events in both encodings, media, lookup by chain."""

from __future__ import annotations

import hashlib
import random
import struct

import pytest

from gateway.prefix.kv_index import KvIndex, block_hashes, salt_seed

A = ("http://a:30000", 0)
A1 = ("http://a:30000", 1)
B = ("http://b:30000", 0)


def reference_hashes(tokens: list[int], page: int, prior: bytes | None = None) -> list[int]:
    """Written from hash_binding.cpp, independently of the module under test."""
    out = []
    for start in range(0, len(tokens) - page + 1, page):
        chunk = tokens[start:start + page]
        if max(chunk) > 0xFFFFFFFF:
            data = b"\xff" + struct.pack(f"<{page}Q", *chunk)
        else:
            data = struct.pack(f"<{page}I", *chunk)
        prior = hashlib.sha256((prior or b"") + data).digest()
        out.append(struct.unpack(">q", prior[:8])[0])
    return out


# Produced by SGLang 0.5.23's own hasher: sglang/srt/mem_cache/cpp_utils/hash_binding.cpp,
# compiled and called as mem_cache/utils.get_hash_str(tokens, prior, page_size), then
# hash_str_to_int64 on each page.
GOLDEN = [
    pytest.param(list(range(1, 17)), 4, None,
                 [-3488128144981237669, 5674439469042975057, -1307369107475853156,
                  -1808607592746456984], id="four_pages_of_four"),
    pytest.param([151644, 8948, 198, 2610, 525, 264, 10950, 17847], 2, None,
                 [-2119194538550650767, -4222886716062130855, 2093639569859360110,
                  7481324178220983331], id="large_vocab_ids"),
    pytest.param([7] * 5, 1, None,
                 [-1702009526849766914, -5103150342063449880, -8154842829495881050,
                  6527818345983237771, 5768762776934061436], id="page_size_1_repeated_token"),
    pytest.param([1, 2**32 + 5, 3, 4], 2, None, [2782409709510075929, -1193698162851623158],
                 id="wide_id_page"),
    pytest.param(list(range(1, 9)), 4, "tenant-a", [3718046898735569995, 3308615664605479373],
                 id="cache_salt_seed"),
]


@pytest.mark.parametrize(("tokens", "page", "salt", "expected"), GOLDEN)
def test_hashes_match_sglang(tokens, page, salt, expected) -> None:
    assert list(block_hashes(tokens, page, salt_seed(salt))) == expected
    assert reference_hashes(tokens, page, salt_seed(salt)) == expected


@pytest.mark.parametrize("page", [1, 3, 16, 64])
def test_hashes_match_independent_implementation(page: int) -> None:
    rng = random.Random(page)
    tokens = [rng.randrange(200_000) for _ in range(300)]
    assert list(block_hashes(tokens, page)) == reference_hashes(tokens, page)
    assert len(list(block_hashes(tokens, page))) == 300 // page  # only full pages


def stored(hashes, parent=None, tokens=None, size=4, medium=None, encoding="map", **extra):
    if encoding == "map":
        event = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                 "token_ids": tokens or [], "block_size": size, "lora_id": None, **extra}
        if medium is not None:
            event["medium"] = medium
        return event
    fields = ["BlockStored", hashes, parent, tokens or [], size, extra.get("lora_id")]
    return fields + ([medium] if medium is not None else [])


def removed(hashes, medium=None, encoding="map"):
    if encoding == "map":
        return {"type": "BlockRemoved", "block_hashes": hashes,
                **({"medium": medium} if medium else {})}
    return ["BlockRemoved", hashes] + ([medium] if medium else [])


def cleared(encoding="map"):
    return {"type": "AllBlocksCleared"} if encoding == "map" else ["AllBlocksCleared"]


ENCODINGS = pytest.mark.parametrize("enc", ["map", "array"])


@ENCODINGS
@pytest.mark.parametrize(
    ("events", "held"),
    [
        pytest.param(lambda e: [stored([1, 2, 3], encoding=e)], {1, 2, 3}, id="stored"),
        pytest.param(lambda e: [stored([1, 2, 3], encoding=e), removed([2], encoding=e)],
                     {1, 3}, id="removed"),
        pytest.param(lambda e: [stored([1, 2], encoding=e), cleared(e),
                                stored([9], encoding=e)], {9}, id="cleared_then_stored"),
        pytest.param(lambda e: [removed([5], encoding=e)], set(), id="remove_unknown_is_noop"),
        pytest.param(lambda e: [stored([1], encoding=e), stored([1], medium="CPU_PINNED",
                                                               encoding=e),
                                removed([1], medium="GPU", encoding=e)],
                     {1}, id="host_copy_survives_gpu_eviction"),
        pytest.param(lambda e: [stored([1], encoding=e), stored([1], medium="CPU_PINNED",
                                                               encoding=e),
                                removed([1], encoding=e), removed([1], medium="CPU_PINNED",
                                                                  encoding=e)],
                     set(), id="gone_when_every_medium_dropped_it"),
        pytest.param(lambda e: [stored([7], encoding=e, lora_id=3)], set(),
                     id="lora_namespaced_blocks_ignored"),
        pytest.param(lambda e: [["SomethingNew", 1], 42, stored([4], encoding=e)], {4},
                     id="unknown_events_skipped"),
        pytest.param(lambda e: [stored(5, encoding=e), stored([[1], 6], encoding=e)], {6},
                     id="malformed_hashes_skipped"),
    ],
)
def test_events_update_the_index(enc, events, held) -> None:
    index = KvIndex(max_blocks=1000)
    index.apply_batch(A, events(enc), now=1.0)
    assert index.blocks_of(A) == held
    assert index.entries == len(held)


def test_block_size_learned_from_events() -> None:
    index = KvIndex(1000)
    index.apply_batch(A, [stored([1], size=16), stored([2], size=5)], now=1.0)
    assert index.block_size("http://a:30000") == 16
    index.set_block_size("http://a:30000", 32)
    assert index.block_size("http://a:30000") == 32


def test_match_counts_leading_blocks_per_worker() -> None:
    tokens = list(range(100, 120))  # 5 blocks of 4
    chain = list(block_hashes(tokens, 4))
    index = KvIndex(1000)
    index.apply_batch(A, [stored(chain[:4])], now=1.0)
    index.apply_batch(A1, [stored(chain[:2])], now=1.0)
    index.apply_batch(B, [stored(chain[:1] + chain[2:])], now=1.0)  # a hole after block 0
    urls = ["http://a:30000", "http://b:30000", "http://c:30000"]
    assert index.match(tokens, urls) == {"http://a:30000": 16, "http://b:30000": 4,
                                         "http://c:30000": 0}
    assert index.match(tokens + [1, 2, 3], urls)["http://a:30000"] == 16


def test_match_with_salt_uses_the_salted_chain() -> None:
    tokens = list(range(8))
    index = KvIndex(1000)
    index.apply_batch(A, [stored(list(block_hashes(tokens, 4, salt_seed("t"))))], now=1.0)
    assert index.match(tokens, ["http://a:30000"]) == {"http://a:30000": 0}
    assert index.match(tokens, ["http://a:30000"], salt_seed("t")) == {"http://a:30000": 8}


def test_block_bound_drops_new_blocks() -> None:
    index = KvIndex(max_blocks=3)
    index.apply_batch(A, [stored([1, 2]), stored([3, 4, 5])], now=1.0)
    assert index.entries == 3 and index.dropped_blocks == 2
    index.apply_batch(A, [removed([1]), stored([6])], now=1.0)
    assert index.blocks_of(A) == {2, 3, 6}


@pytest.mark.parametrize(
    ("events_at", "dispatch_at", "now", "fresh"),
    [
        pytest.param(None, None, 100.0, False, id="never_heard_from"),
        pytest.param(10.0, None, 100.0, True, id="quiet_without_traffic_is_fine"),
        pytest.param(10.0, 95.0, 100.0, True, id="traffic_just_sent"),
        pytest.param(10.0, 50.0, 100.0, False, id="traffic_without_events_for_too_long"),
    ],
)
def test_freshness(events_at, dispatch_at, now, fresh) -> None:
    index = KvIndex(10)
    if events_at is not None:
        index.apply_batch(A, [], now=events_at)
    if dispatch_at is not None:
        index.note_dispatch(A[0], dispatch_at)
    assert index.is_fresh(A[0], now, stale_after=30.0) is fresh


def test_event_after_dispatch_clears_pending() -> None:
    index = KvIndex(10)
    index.apply_batch(A, [], now=1.0)
    index.note_dispatch(A[0], 2.0)
    index.apply_batch(A, [], now=3.0)
    assert index.is_fresh(A[0], 100.0, stale_after=30.0)


def test_remove_worker() -> None:
    index = KvIndex(100)
    index.apply_batch(A, [stored([1, 2])], now=1.0)
    index.apply_batch(A1, [stored([2, 3])], now=1.0)
    index.apply_batch(B, [stored([2])], now=1.0)
    index.remove_server("http://a:30000")
    assert index.entries == 1 and index.servers() == {"http://b:30000"}
    assert index.match([0] * 4, ["http://b:30000"]) == {"http://b:30000": 0}
