"""SGLang's KV block hash (sglang/srt/mem_cache/utils.py + hash_binding.cpp).

Each page's digest is SHA-256 over the previous page's 32-byte digest (absent
for the first page) followed by the page's token ids as little-endian uint32.
The published block hash is the digest's first 8 bytes read big-endian as a
signed int64 (`hash_str_to_int64` takes the first 16 hex characters).
"""

from __future__ import annotations

import hashlib
import struct


def page_digest(prior: bytes | None, tokens: list[int]) -> bytes:
    """Digest of one page chained to the digest of the page before it."""
    h = hashlib.sha256()
    if prior is not None:
        h.update(prior)
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return h.digest()


def digest_to_int64(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "big", signed=True)


def chain_digests(prior: bytes | None, tokens: list[int], page_size: int) -> list[bytes]:
    """Digests of consecutive pages of `tokens`, continuing from `prior`."""
    out: list[bytes] = []
    for start in range(0, len(tokens), page_size):
        prior = page_digest(prior, tokens[start : start + page_size])
        out.append(prior)
    return out
