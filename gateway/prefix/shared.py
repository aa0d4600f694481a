"""Where the other worker processes sent their prompts (`--workers N`): one hash table in the
shared block, read by cache_aware beside its own prefix tree.

Why: cache_aware's tree (policies/prefix_tree.py) knows only what its own process routed, and
the kernel hands a conversation's turns to any of the N processes. A process that did not route
turn k does not know which server holds it; measured on the chat workload, 4 workers lost
0.8-5.0 points of hit ratio against 1 (docs/WORKERS.md). So every process records, per request,
where its prompt went, and a process routing a prompt looks up the prompt's own prefixes: the
previous turn of its conversation, routed by whichever process.

What is kept is deliberately small, one entry per request and no second tree:
- a prompt's bytes (text as UTF-8, token ids as 4-byte words) cut into BLOCK-byte blocks; the
  prompt is recorded under its longest block-aligned prefix, as `(crc, length)` with the CRC-32
  of that prefix (zlib's crc32 chains block by block, so every prefix's CRC comes from one
  pass), and the entry holds the target's hash and when;
- a lookup computes the CRCs of the new prompt's last `SCAN` block-aligned prefixes and takes
  the longest one recorded for a candidate target: a continuation whose new part is under
  `SCAN * BLOCK` bytes (the answer and the next user message) is found; older or shorter
  shared parts are what each process's own tree already knows (every process sees every
  popular system prompt);
- buckets of 4 entries in a fixed table; a new entry takes an empty slot or the oldest; no
  locks: each entry is two aligned 8-byte words written value first, and a reader that sees a
  tag change under it drops the entry (a lost entry costs one hit, never a wrong answer: the
  routing is a guess either way).
A CRC is not a cryptographic hash: a client that forges collisions can only make its own prompt
look cached somewhere, which steers nothing it could not steer by sending that prompt.
"""

from __future__ import annotations

import zlib
from array import array
from collections.abc import Sequence

from gateway.prefix.tree import Key, Match

BLOCK = 256  # bytes of a block: 256 characters of ASCII text, 64 tokens
SCAN = 16  # block-aligned prefixes looked up per prompt, longest first
ENTRIES = 1 << 20  # 16 MB of shared memory: at 20k requests/s, the last ~50 s of prompts
WORDS = 2 * ENTRIES
_BUCKET = 4
_TIME_BITS = 31  # deciseconds of time.monotonic(), modulo 2**31 (about 6.8 years)
_TIME_MASK = (1 << _TIME_BITS) - 1


def _tag(crc: int, length: int) -> int:
    """A non-zero 63-bit tag of a prefix (0 marks an empty entry)."""
    return ((crc << 31) | (length & 0x7FFFFFFF)) or 1


def target_hash(url: str) -> int:
    return zlib.crc32(url.encode())


def key_bytes(key: Key) -> tuple[bytes, int]:
    """The bytes a key is hashed as, and the bytes one key item takes (0: text, UTF-8)."""
    if isinstance(key, str):
        return key.encode("utf-8", "surrogatepass"), 0
    try:
        return array("I", key).tobytes(), 4
    except OverflowError:
        return array("q", key).tobytes(), 8


class SharedPrefixes:
    """The table, over `WORDS` 8-byte words of shared memory (or any buffer, in tests)."""

    def __init__(self, words: memoryview) -> None:
        if len(words) < WORDS:
            raise ValueError(f"the prefix table needs {WORDS} words, got {len(words)}")
        self.words = words
        self._mask = ENTRIES // _BUCKET - 1
        self._memo: tuple[object, bytes, int] = ("", b"", 0)
        self._longest: int | None = None  # the CRC of the memo's longest block-aligned prefix
        self._hashes: dict[str, int] = {}  # target URL -> target_hash (servers: a few)

    def _bytes(self, key: Key) -> tuple[bytes, int]:
        """`key_bytes`, remembered for the last key (pick and dispatch pass the same one)."""
        source, data, width = self._memo
        if source is not key:
            data, width = key_bytes(key)
            self._memo = (key, data, width)
            self._longest = None
        return data, width

    def blocks(self, key: Key) -> int:
        """Whole blocks in `key`'s bytes: none, and nothing of it can be in the table (asked
        before a lookup, whose candidates' list and clock a short prompt never needs)."""
        return len(self._bytes(key)[0]) // BLOCK

    def _bucket(self, tag: int) -> int:
        return 2 * _BUCKET * (((tag >> 31) ^ (tag * 0x9E3779B1)) & self._mask)

    def record(self, key: Key, target: str, now: float) -> None:
        """`key` was sent to `target` at `now` (time.monotonic(): one clock for all processes)."""
        data, _ = self._bytes(key)
        length = len(data) - len(data) % BLOCK
        if not length:
            return
        # the CRC of that prefix: the lookup of the same key (the pick) took it already
        crc = self._longest if self._longest is not None else \
            zlib.crc32(memoryview(data)[:length])
        tag = _tag(crc, length)
        words = self.words
        base = self._bucket(tag)
        held = words[base:base + 2 * _BUCKET].tolist()  # one read of the bucket's 4 entries
        tags = held[0::2]
        if tag in tags:
            slot = base + 2 * tags.index(tag)
        elif 0 in tags:
            slot = base + 2 * tags.index(0)
        else:  # the oldest entry gives way
            now_ds = int(now * 10)
            ages = [(now_ds - (value & _TIME_MASK)) & _TIME_MASK for value in held[1::2]]
            slot = base + 2 * ages.index(max(ages))
        words[slot + 1] = (self._hash_of(target) << _TIME_BITS) | (int(now * 10) & _TIME_MASK)
        words[slot] = tag

    def find(self, key: Key, targets: Sequence[str], now: float,
             known: int = 0) -> tuple[str, int, float] | None:
        """The longest prefix of `key` recorded for one of `targets`, longer than `known` key
        items: (target, its length in key items, when it was sent there); None if none."""
        data, width = self._bytes(key)
        blocks = len(data) // BLOCK
        first = max(1, blocks - SCAN + 1)
        if blocks < first:
            return None
        view = memoryview(data)
        crc = zlib.crc32(view[:(first - 1) * BLOCK])
        crcs = []
        for block in range(first, blocks + 1):
            crc = zlib.crc32(view[(block - 1) * BLOCK:block * BLOCK], crc)
            crcs.append(crc)
        self._longest = crc  # the record of this key, after the pick, needs it again
        words = self.words
        for block in range(blocks, first - 1, -1):
            length = block * BLOCK
            if (length // width if width else length) <= known:  # text: bytes >= characters
                return None
            tag = _tag(crcs[block - first], length)
            base = self._bucket(tag)
            held = words[base:base + 2 * _BUCKET].tolist()
            tags = held[0::2]
            if tag not in tags:
                continue
            at = tags.index(tag)
            if words[base + 2 * at] != tag:  # overwritten since it was read
                continue
            value = held[2 * at + 1]
            target = self._target_of(value >> _TIME_BITS, targets)
            if target is not None:
                now_ds = int(now * 10)
                when = (now_ds - ((now_ds - (value & _TIME_MASK)) & _TIME_MASK)) / 10
                if width:
                    items = length // width
                elif len(data) == len(key):  # one byte per character
                    items = length
                else:
                    items = len(data[:length].decode("utf-8", "ignore"))
                return target, items, when
        return None

    def _target_of(self, hashed: int, targets: Sequence[str]) -> str | None:
        """The target among `targets` whose hash an entry holds."""
        for target in targets:
            if self._hash_of(target) == hashed:
                return target
        return None

    def _hash_of(self, target: str) -> int:
        """`target_hash`, kept per URL (the targets are the servers: a few)."""
        hashed = self._hashes.get(target)
        if hashed is None:
            hashed = self._hashes[target] = target_hash(target)
        return hashed


def merged(matched: Match, found: tuple[str, int, float] | None) -> Match:
    """The tree's `matched` plus what another process recorded: the target that was sent the
    longer prefix matches that much, and holds the deepest earlier key (a continuation)."""
    if found is None:
        return matched
    target, length, when = found
    result = Match(matched)
    result[target] = max(length, matched.get(target, 0))
    result.end, result.ends = matched.end, matched.ends
    if length > matched.end:
        result.end, result.ends = length, {target: when}
    elif length == matched.end:
        result.ends = {**matched.ends, target: max(when, matched.ends.get(target, 0.0))}
    return result
