"""A trivial, reversible tokenizer and a deterministic "model".

Tokenizer: the UTF-8 bytes of the text cut into 4-byte chunks, each chunk read
as a little-endian uint32 (the last chunk zero-padded). Roughly one token per
4 characters of English, like real BPE vocabularies, every id fits the uint32
the SGLang block hash needs, and texts sharing a prefix share token ids.

Model: every generated token is one of ~1000 three-letter words with a
leading space (exactly 4 bytes, so one token each). The word at output
position i depends only on the prompt token ids and i (greedy), so a
prefill/decode pair and a plain server produce the same text for the same
prompt; a sampled request (temperature > 0) also mixes in its rid or seed.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable
from typing import Any

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
WORDS: tuple[str, ...] = tuple(
    f" {a}{v}{b}" for a in _CONSONANTS for v in _VOWELS for b in _CONSONANTS
)
WORD_IDS: tuple[int, ...] = tuple(int.from_bytes(w.encode(), "little") for w in WORDS)
MAX_TOKEN_ID = 2**32 - 1


def encode(text: str) -> list[int]:
    """Text to token ids: 4 UTF-8 bytes per token (struct: one C call, not a loop)."""
    data = text.encode("utf-8")
    data += b"\x00" * ((-len(data)) % 4)
    return list(struct.unpack(f"<{len(data) // 4}I", data))


def token_bytes(token_id: int) -> bytes:
    """The bytes one token stands for (padding stripped)."""
    return (token_id & MAX_TOKEN_ID).to_bytes(4, "little").rstrip(b"\x00")


def decode(token_ids: Iterable[int]) -> str:
    """Token ids back to text; invalid UTF-8 becomes U+FFFD."""
    return b"".join(token_bytes(t) for t in token_ids).decode("utf-8", errors="replace")


def token_text(token_id: int) -> str:
    return token_bytes(token_id).decode("utf-8", errors="replace")


def prompt_seed(token_ids: list[int]) -> bytes:
    """A 16-byte digest of the prompt that drives generation."""
    h = hashlib.blake2b(digest_size=16)
    h.update(len(token_ids).to_bytes(8, "little"))
    for start in range(0, len(token_ids), 4096):
        chunk = [t & MAX_TOKEN_ID for t in token_ids[start : start + 4096]]
        h.update(struct.pack(f"<{len(chunk)}I", *chunk))
    return h.digest()


def sample_seed(prompt: bytes, key: bytes) -> bytes:
    """The seed of one sampled (temperature > 0) generation: the prompt's seed mixed with
    what tells samples apart (their rid, or the request's sampling_seed)."""
    return hashlib.blake2b(prompt + key, digest_size=16).digest()


def _draw(seed: bytes, position: int, salt: int = 0) -> int:
    data = seed + position.to_bytes(4, "little") + salt.to_bytes(2, "little")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def output_token(seed: bytes, position: int) -> tuple[int, float]:
    """The (token id, logprob) generated at output position `position`."""
    h = _draw(seed, position)
    logprob = round(-(((h >> 24) % 4000) / 1000.0) - 0.001, 4)
    return WORD_IDS[h % len(WORD_IDS)], logprob


def top_logprobs(seed: bytes, position: int, k: int) -> list[tuple[float, int]]:
    """The k most likely tokens at a position: the chosen one first."""
    if k <= 0:
        return []
    chosen, lp = output_token(seed, position)
    result = [(lp, chosen)]
    salt = 1
    while len(result) < k:
        h = _draw(seed, position, salt)
        token = WORD_IDS[h % len(WORD_IDS)]
        if all(token != t for _, t in result):
            result.append((round(lp - 0.25 * salt - ((h >> 24) % 100) / 1000.0, 4), token))
        salt += 1
    return result


def input_logprob(token_ids: list[int], position: int) -> float | None:
    """Logprob of prompt token `position`; the first token has none."""
    if position == 0:
        return None
    prev = token_ids[position - 1] & MAX_TOKEN_ID
    cur = token_ids[position] & MAX_TOKEN_ID
    h = _draw(prev.to_bytes(4, "little") + cur.to_bytes(4, "little"), position)
    return round(-((h % 8000) / 1000.0) - 0.001, 4)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            elif isinstance(part, str):
                parts.append(part)
        return "".join(parts)
    return str(content)


def render_chat(messages: list[dict[str, Any]], continue_final: bool = False) -> str:
    """The sim's chat template: role-tagged turns, then the assistant tag.

    With `continue_final` and a last assistant message of text, that message is the start of
    the answer: the turn stays open after its text (mirrors
    OpenAIServingChat._handle_last_assistant_message and _append_assistant_prefix_to_prompt_ids).
    """
    prefix = ""
    if continue_final and messages and messages[-1].get("role") == "assistant" \
            and isinstance(messages[-1].get("content"), str):
        prefix = messages[-1]["content"]
        messages = messages[:-1]
    lines = [
        f"<|{m.get('role', 'user')}|>\n{_content_text(m.get('content'))}<|end|>\n" for m in messages
    ]
    lines.append("<|assistant|>\n" + prefix)
    return "".join(lines)
