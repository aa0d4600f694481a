"""Exact prefix-cache state per server, from SGLang's KV cache events (a helper, not a policy).

Block hashes (SGLang 0.5.23, `mem_cache/cpp_utils/hash_binding.cpp` via `mem_cache/utils.py`):
page i of a prompt hashes to SHA-256(digest of page i-1, if any || the page's token ids as
little-endian uint32); a page holding an id above 2^32-1 is hashed as 0xff || uint64 ids instead.
The event carries the first 8 bytes of the digest as a big-endian signed int64
(`hash_str_to_int64`). Only full pages are cached. A request with `cache_salt` starts its chain
from SHA-256(b"sglang-cache-salt-v1\\0" || salt); LoRA requests are hashed in a namespace we do
not reproduce, so their events are ignored and their requests use the approximate tree.

Events (`disaggregation/kv_events.py`) are msgpack maps with a "type" key (0.5.23) or, from
older releases and vLLM, arrays `[type, *fields]` in the struct's field order (below). A block
may sit in several media (GPU, CPU_PINNED with HiCache, ...); it counts as cached while any
medium holds it, because a host-memory hit still saves the prefill.

Sources are (server url, dp rank): each attention-DP rank has its own cache and publisher; a
server's match is its best rank's.

Cost: ~140 bytes per (block, source) entry (measured with tracemalloc, 8 sources x 100k blocks),
hence the `max_blocks` bound; a lookup hashes the prompt's pages until no source holds one
(~0.7 us a page: 512 tokens at page size 16 take ~30 us, at page size 1 ~360 us).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

Source = tuple[str, int]

ARRAY_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": (
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
        "cache_salt", "session_id", "lora_name",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}
MEDIA = {"GPU": 1, "CPU_PINNED": 2, "DISK": 4, "EXTERNAL": 8}
OTHER_MEDIUM = 16
SALT_TAG = b"sglang-cache-salt-v1\0"


def salt_seed(cache_salt: str | None) -> bytes | None:
    """The digest a salted request's hash chain starts from."""
    if cache_salt is None:
        return None
    return hashlib.sha256(SALT_TAG + cache_salt.encode("utf-8")).digest()


def block_hashes(tokens: Sequence[int], block_size: int, seed: bytes | None = None) -> Iterator[int]:
    """SGLang's event hashes of the full pages of `tokens`, computed lazily (stop early)."""
    full = len(tokens) // block_size * block_size
    try:
        data: memoryview | None = memoryview(array("I", tokens[:full])).cast("B")
    except OverflowError:
        data = None
    step = 4 * block_size
    prior = seed
    for index in range(full // block_size):
        digest = hashlib.sha256(prior) if prior is not None else hashlib.sha256()
        if data is not None:
            digest.update(data[index * step:(index + 1) * step])
        else:
            page = tokens[index * block_size:(index + 1) * block_size]
            try:
                digest.update(array("I", page))
            except OverflowError:
                digest.update(b"\xff")
                digest.update(array("Q", page))
        prior = digest.digest()
        yield int.from_bytes(prior[:8], "big", signed=True)


def event_fields(event: Any) -> tuple[str, dict]:
    """(type, fields) of an event in either encoding; ("", {}) if unrecognised."""
    if isinstance(event, dict):
        kind = event.get("type", "")
        fields = event
    elif isinstance(event, (list, tuple)) and event:
        kind = event[0]
        names = ARRAY_FIELDS.get(kind.decode() if isinstance(kind, bytes) else kind, ())
        fields = dict(zip(names, event[1:], strict=False))  # trailing defaults may be omitted
    else:
        return "", {}
    if isinstance(kind, bytes):
        kind = kind.decode()
    return (kind, fields) if isinstance(kind, str) else ("", {})


class KvIndex:
    """Which source holds which block, plus per-server freshness of the event stream."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks  # (block, source) entries over all sources
        # Holders are bitmasks over source bits: an int per block instead of a set (~3x smaller)
        # and the chain walk in `match` is integer AND.
        self._holders: dict[int, int] = {}  # block hash -> bits of the sources holding it
        self._blocks: dict[Source, dict[int, int]] = {}  # block hash -> media bitmask
        self._sources: dict[str, set[Source]] = {}
        self._bit: dict[Source, int] = {}
        self._free_bits: list[int] = []
        self._block_size: dict[str, int] = {}
        self._fixed_block_size: dict[str, int] = {}
        self._last_event: dict[str, float] = {}
        self._pending_since: dict[str, float] = {}
        self._entries = 0
        self.dropped_blocks = 0
        self.unknown_events = 0

    @property
    def entries(self) -> int:
        return self._entries

    def block_size(self, url: str) -> int:
        return self._fixed_block_size.get(url) or self._block_size.get(url, 0)

    def set_block_size(self, url: str, size: int) -> None:
        """Fix the page size of `url` (from options or `/server_info`), over what events imply."""
        self._fixed_block_size[url] = size

    def servers(self) -> set[str]:
        """Server urls the index knows anything about."""
        return set(self._sources) | set(self._last_event) | set(self._fixed_block_size)

    def blocks_of(self, source: Source) -> set[int]:
        return set(self._blocks.get(source, ()))

    # --- updates from the event stream -------------------------------------------------------

    def apply_batch(self, source: Source, events: Iterable[Any], now: float) -> None:
        self.note_event(source[0], now)
        for event in events:
            self.apply_event(source, event)

    def apply_event(self, source: Source, event: Any) -> None:
        kind, fields = event_fields(event)
        if kind == "BlockStored":
            if fields.get("lora_id") is not None or fields.get("lora_name") is not None:
                return  # namespaced hashes: no request of ours can match them
            size = fields.get("block_size")
            if isinstance(size, int) and size > self._block_size.get(source[0], 0):
                self._block_size[source[0]] = size  # a partial last page reports fewer
            self._store(source, _hashes(fields), _medium(fields.get("medium")))
        elif kind == "BlockRemoved":
            self._remove(source, _hashes(fields), _medium(fields.get("medium")))
        elif kind == "AllBlocksCleared":
            self.clear(source)
        else:
            self.unknown_events += 1

    def _store(self, source: Source, hashes: Iterable[int], bit: int) -> None:
        blocks = self._blocks.get(source)
        if blocks is None:
            blocks = self._blocks[source] = {}
            self._sources.setdefault(source[0], set()).add(source)
            self._bit[source] = self._free_bits.pop() if self._free_bits else 1 << len(self._bit)
        holder = self._bit[source]
        holders = self._holders
        for block in hashes:
            mask = blocks.get(block)
            if mask is None:
                if self._entries >= self.max_blocks:
                    self.dropped_blocks += 1  # under-estimates this worker's cache: safe
                    continue
                blocks[block] = bit
                holders[block] = holders.get(block, 0) | holder
                self._entries += 1
            else:
                blocks[block] = mask | bit

    def _remove(self, source: Source, hashes: Iterable[int], bit: int) -> None:
        blocks = self._blocks.get(source)
        if not blocks:
            return
        for block in hashes:
            mask = blocks.get(block)
            if mask is None:
                continue
            mask &= ~bit
            if mask:
                blocks[block] = mask
            else:
                self._forget(source, blocks, block)

    def _forget(self, source: Source, blocks: dict[int, int], block: int) -> None:
        del blocks[block]
        self._entries -= 1
        left = self._holders.get(block, 0) & ~self._bit[source]
        if left:
            self._holders[block] = left
        else:
            self._holders.pop(block, None)

    def clear(self, source: Source) -> None:
        """Forget everything `source` holds (cleared cache, restart, unrecoverable gap)."""
        blocks = self._blocks.get(source)
        if blocks:
            for block in list(blocks):
                self._forget(source, blocks, block)

    def remove_server(self, url: str) -> None:
        for source in self._sources.pop(url, set()):
            self.clear(source)
            self._blocks.pop(source, None)
            self._free_bits.append(self._bit.pop(source))
        for table in (self._block_size, self._fixed_block_size, self._last_event,
                      self._pending_since):
            table.pop(url, None)

    # --- freshness -----------------------------------------------------------------------------

    def note_event(self, url: str, now: float) -> None:
        self._last_event[url] = now
        self._pending_since.pop(url, None)

    def note_dispatch(self, url: str, now: float) -> None:
        """A request went to `url`: its events should follow soon."""
        self._pending_since.setdefault(url, now)

    def is_fresh(self, url: str, now: float, stale_after: float) -> bool:
        """Events were seen, and none is overdue for traffic sent since the last one."""
        if url not in self._last_event:
            return False
        since = self._pending_since.get(url)
        return since is None or now - since <= stale_after

    # --- lookup ----------------------------------------------------------------------------------

    def match(self, tokens: Sequence[int], targets: Iterable[str | Source],
              seed: bytes | None = None) -> dict:
        """Cached leading tokens of `tokens` per target (whole blocks). A target is a server
        url (its best DP rank counts) or a (url, rank) source (that rank alone: each rank
        has its own cache). The result is keyed by the targets as given."""
        result: dict = {}
        groups: dict[int, list] = {}
        for target in targets:
            result[target] = 0
            url = target if isinstance(target, str) else target[0]
            size = self.block_size(url)
            if size > 0 and url in self._sources:
                groups.setdefault(size, []).append(target)
        for size, group in groups.items():
            owner: dict[int, list] = {}
            for target in group:
                if isinstance(target, str):
                    for src in self._sources[target]:
                        owner.setdefault(self._bit[src], []).append(target)
                elif target in self._bit:
                    owner.setdefault(self._bit[target], []).append(target)
            alive = sum(owner)
            depth = 0
            for block in block_hashes(tokens, size, seed):
                if not alive:
                    break
                held = self._holders.get(block, 0) & alive
                if held != alive:
                    self._record(result, owner, alive & ~held, depth * size)
                    alive = held
                    if not alive:
                        break
                depth += 1
            self._record(result, owner, alive, depth * size)
        return result

    @staticmethod
    def _record(result: dict, owner: dict[int, list], bits: int, length: int) -> None:
        """Each source in `bits` matched `length` tokens; a target keeps its best source."""
        while bits:
            bit = bits & -bits
            bits ^= bit
            for target in owner[bit]:
                if length > result[target]:
                    result[target] = length

    def stats(self) -> dict:
        return {
            "blocks": self._entries,
            "max_blocks": self.max_blocks,
            "dropped_blocks": self.dropped_blocks,
            "unknown_events": self.unknown_events,
            "blocks_by_worker": {
                url: sum(len(self._blocks.get(s, ())) for s in sources)
                for url, sources in self._sources.items()
            },
        }


def _hashes(fields: dict) -> list:
    """The event's block hashes; malformed entries are skipped rather than trusted."""
    value = fields.get("block_hashes")
    if not isinstance(value, (list, tuple)):
        return []
    return [h for h in value if isinstance(h, (int, bytes))]


def _medium(value: Any) -> int:
    if value is None:
        return MEDIA["GPU"]
    return MEDIA.get(value, OTHER_MEDIUM) if isinstance(value, str) else OTHER_MEDIUM
