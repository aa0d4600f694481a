"""Merge the prompt logprobs that only the prefill server holds into the decode answer.

In PD mode the prefill computes the prompt, so the native API's prompt logprobs
(`meta_info.input_token_logprobs`, and with `top_logprobs_num` or `token_ids_logprob`
`input_top_logprobs` and `input_token_ids_logprobs`) and the prompt part of OpenAI
completions logprobs with `echo` live in the prefill's answer.
The client must get them in front of the decode's own entries, in every streamed chunk that
carries them and in the final JSON.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.request import COMPLETIONS, GENERATE
from gateway.sse import data_objects

LOGPROB_LISTS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
# the native API's per-prompt-token lists, aligned: each one the prefill sends is merged (only
# the first was: a client asking for top logprobs got prompt tokens without their top ones)
INPUT_LISTS = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")


def prefill_parts(endpoint: str, body: bytes) -> dict[int, Any]:
    """Index -> what the prefill knows about the prompt of item `index`.

    For /generate: the `INPUT_LISTS` it sent, by name. For completions: the prompt entries
    of the choice's `logprobs` (all entries but the prefill's single generated token).
    """
    items: list[dict]
    if body.lstrip()[:5] == b"data:":
        items = data_objects(body)
    else:
        data = orjson.loads(body)
        items = data if isinstance(data, list) else [data]
    parts: dict[int, Any] = {}
    for position, item in enumerate(items):
        if endpoint == GENERATE:
            meta = item.get("meta_info") or {}
            index = item.get("index", position)
            if index not in parts and meta.get("input_token_logprobs") is not None:
                parts[index] = {key: meta[key] for key in INPUT_LISTS
                                if isinstance(meta.get(key), list)}
        elif endpoint == COMPLETIONS:
            for choice in item.get("choices") or []:
                index = choice.get("index", 0)
                logprobs = choice.get("logprobs")
                if index in parts or not logprobs:
                    continue
                generated = 0 if item.get("object", "").endswith("chunk") else 1
                parts[index] = {
                    key: _prompt_slice(logprobs.get(key), generated) for key in LOGPROB_LISTS
                }
    return parts


def _prompt_slice(values: list | None, generated: int) -> list:
    if not values:
        return []
    return values[: len(values) - generated] if generated else list(values)


def merge_generate_item(item: dict, prompt_lists: dict[str, list] | None) -> None:
    if prompt_lists is None:
        return
    meta = item.setdefault("meta_info", {})
    for key, prompt in prompt_lists.items():
        meta[key] = prompt + (meta.get(key) or [])


def merge_completion(obj: dict, parts: dict[int, Any], seen: set[int] | None = None) -> None:
    """Prepend prompt logprobs to each choice once (first chunk per index when streaming).

    A decode server in PD mode computes no prompt logprobs (it never ran the prompt), so its
    entries are all generated tokens and go after the prefill's prompt entries unchanged.
    """
    for choice in obj.get("choices") or []:
        index = choice.get("index", 0)
        part = parts.get(index)
        logprobs = choice.get("logprobs")
        if part is None or logprobs is None or (seen is not None and index in seen):
            continue
        if seen is not None:
            seen.add(index)
        for key in LOGPROB_LISTS:
            own = logprobs.get(key) or []
            logprobs[key] = part[key] + own


def merge_body(endpoint: str, body: bytes, parts: dict[int, Any]) -> bytes:
    """Merge a whole non-streaming decode answer."""
    data = orjson.loads(body)
    if endpoint == GENERATE:
        items = data if isinstance(data, list) else [data]
        for position, item in enumerate(items):
            merge_generate_item(item, parts.get(item.get("index", position)))
    elif endpoint == COMPLETIONS and isinstance(data, dict):
        merge_completion(data, parts)
    return orjson.dumps(data)


class StreamMerger:
    """Merges each streamed decode event; keeps per-index state for completions."""

    def __init__(self, endpoint: str, parts: dict[int, Any]) -> None:
        self.endpoint = endpoint
        self.parts = parts
        self._seen: set[int] = set()

    def merge(self, obj: dict) -> dict:
        if self.endpoint == GENERATE:
            merge_generate_item(obj, self.parts.get(obj.get("index", 0)))
        elif self.endpoint == COMPLETIONS:
            merge_completion(obj, self.parts, self._seen)
        return obj
