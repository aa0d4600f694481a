"""Request bodies to items, normalized the way SGLang's GenerateReqInput does.

A single prompt gives one item; a list of prompts (a batch) or `n > 1` gives
several, ordered prompt-major (item = prompt * n + sample). A scalar
`bootstrap_room` expands to `room + item` and a list is repeated per sample,
exactly like `_normalize_bootstrap_params`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from backends.sim import tokenizer
from backends.sim.config import SimConfig
from backends.sim.job import ItemSpec


class BadRequest(ValueError):
    """Input SGLang rejects with HTTP 400."""


@dataclass(frozen=True)
class ParsedRequest:
    items: list[ItemSpec]
    is_single: bool
    stream: bool


def _per_item(value: Any, count: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != count:
            raise BadRequest(f"The length of {name} should be equal to the batch size.")
        return value
    return [value] * count


def _stop_list(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise BadRequest("stop should be a string or a list of strings.")


def _prompts(body: dict[str, Any]) -> tuple[list[list[int]], list[str | None], bool]:
    text, ids = body.get("text"), body.get("input_ids")
    if text is not None:
        texts = [text] if isinstance(text, str) else text
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise BadRequest("text should be a string or a list of strings.")
        return [tokenizer.encode(t) for t in texts], list(texts), isinstance(text, str)
    if ids is None:
        raise BadRequest("Either text, input_ids or input_embeds should be provided.")
    if not isinstance(ids, list) or not ids:
        raise BadRequest("input_ids cannot be empty.")
    single = isinstance(ids[0], int)
    batch = [ids] if single else ids
    for seq in batch:
        if not isinstance(seq, list) or not all(isinstance(t, int) for t in seq):
            raise BadRequest("input_ids should be a list of ints or a list of lists of ints.")
        if any(t < 0 or t > tokenizer.MAX_TOKEN_ID for t in seq):
            raise BadRequest("input_ids contain a token id outside [0, 2**32).")
    return [list(s) for s in batch], [None] * len(batch), single


def new_rid() -> str:
    """A random 32-hex-digit rid like SGLang's uuid4().hex, without uuid4's getrandom syscall."""
    return f"{random.getrandbits(128):032x}"


def _rids(rid: Any, count: int, single: bool) -> list[str]:
    if rid is None:
        return [new_rid() for _ in range(count)]
    if isinstance(rid, str):
        return [rid] if single and count == 1 else [f"{rid}_{i}" for i in range(count)]
    if isinstance(rid, list) and len(rid) == count and all(isinstance(r, str) for r in rid):
        if len(set(rid)) != len(rid):
            raise BadRequest("Duplicate request IDs in one batch.")
        return list(rid)
    raise BadRequest("The rid should be a string or a list of strings.")


def _rooms(value: Any, prompts: int, n: int) -> list[int | None]:
    count = prompts * n
    if value is None:
        return [None] * count
    if isinstance(value, list):
        if len(value) != prompts:
            raise BadRequest("The length of bootstrap_room should be equal to the batch size.")
        return [_as_room(value[i // n]) for i in range(count)]
    room = _as_room(value)
    return [room + i for i in range(count)] if room is not None else [None] * count


def _as_room(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
        raise BadRequest("bootstrap_room should be an integer in [0, 2**63).")
    return value


def parse_generate(body: Any, config: SimConfig) -> ParsedRequest:
    """Normalize a native /generate body (GenerateReqInput)."""
    if not isinstance(body, dict):
        raise BadRequest("The request body should be a JSON object.")
    prompt_ids, prompt_texts, single = _prompts(body)
    batch = len(prompt_ids)
    sp_raw = body.get("sampling_params") or {}
    sps = _per_item(sp_raw, batch, "sampling_params")
    if not all(isinstance(sp, dict) for sp in sps):
        raise BadRequest("sampling_params should be a dict or a list of dicts.")
    n = int(sps[0].get("n", 1) or 1)
    if n < 1 or any(int(sp.get("n", 1) or 1) != n for sp in sps):
        raise BadRequest("The parallel_sample_num should be the same for all samples in sample params.")
    count = batch * n
    is_single = single and n == 1
    rids = _rids(body.get("rid"), count, is_single)
    rooms = _rooms(body.get("bootstrap_room"), batch, n)
    hosts = _expand(body.get("bootstrap_host"), batch, n, "bootstrap_host")
    ports = _expand(body.get("bootstrap_port"), batch, n, "bootstrap_port")
    logprob = _per_item(body.get("return_logprob", False), batch, "return_logprob")
    start_len = _per_item(body.get("logprob_start_len", -1), batch, "logprob_start_len")
    top_n = _per_item(body.get("top_logprobs_num", 0), batch, "top_logprobs_num")
    items = []
    for i in range(count):
        b = i // n
        sp = sps[b]
        ids = prompt_ids[b]
        if not ids:
            raise BadRequest("The input prompt is empty.")
        max_new = sp.get("max_new_tokens")
        max_new = config.default_max_new_tokens if max_new is None else max_new
        if not isinstance(max_new, int) or max_new < 0:
            raise BadRequest("max_new_tokens must be a non-negative integer.")
        if len(ids) >= config.context_length:
            raise BadRequest(f"The input ({len(ids)} tokens) is longer than the model's "
                             f"context length ({config.context_length} tokens).")
        items.append(ItemSpec(
            index=i, rid=rids[i], input_ids=ids, text=prompt_texts[b],
            max_new_tokens=min(max_new, config.context_length - len(ids)),
            stop=_stop_list(sp.get("stop")),
            stop_token_ids=frozenset(sp.get("stop_token_ids") or ()),
            return_logprob=bool(logprob[b]),
            logprob_start_len=-1 if start_len[b] is None else int(start_len[b]),
            top_logprobs_num=int(top_n[b] or 0),
            bootstrap_host=hosts[i], bootstrap_port=_as_port(ports[i]), bootstrap_room=rooms[i],
            stream=bool(body.get("stream", False)),
        ))
    return ParsedRequest(items=items, is_single=is_single, stream=bool(body.get("stream", False)))


def _expand(value: Any, prompts: int, n: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != prompts:
            raise BadRequest(f"The length of {name} should be equal to the batch size.")
        return [value[i // n] for i in range(prompts * n)]
    return [value] * (prompts * n)


def _as_port(value: Any) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise BadRequest("bootstrap_port should be an integer.") from None


_PD_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room", "rid")


def openai_to_generate(body: dict[str, Any], prompt: Any, max_tokens: Any,
                       logprobs: bool, top_logprobs: int, logprob_start_len: int) -> dict[str, Any]:
    """The GenerateReqInput an OpenAI request becomes (serving_*.py)."""
    stop = body.get("stop")
    sampling = {
        "max_new_tokens": max_tokens, "stop": stop, "n": body.get("n", 1) or 1,
        "stop_token_ids": body.get("stop_token_ids"), "ignore_eos": body.get("ignore_eos", False),
        "temperature": body.get("temperature"),
    }
    key = "text" if isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt and isinstance(prompt[0], str)) else "input_ids"
    out = {key: prompt, "sampling_params": sampling, "return_logprob": logprobs,
           "top_logprobs_num": top_logprobs, "logprob_start_len": logprob_start_len,
           "stream": bool(body.get("stream", False))}
    out.update({k: body[k] for k in _PD_FIELDS if body.get(k) is not None})
    return out
