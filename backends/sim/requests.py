"""Request bodies to items, normalized the way SGLang's GenerateReqInput does.

A single prompt gives one item, a list of prompts (a batch) one item per
prompt. With `n > 1` (parallel sampling) the answer is n samples per prompt,
ordered prompt-major (item = prompt * n + sample), and each prompt first gets
a warm-up prefill (`max_new_tokens` 0) that must finish before its samples
start. Each warm-up and each sample carries the bootstrap room of its prompt,
`obj[i].bootstrap_room`: one room serves n + 1 requests, which PD pairing
cannot satisfy (the naive PD n > 1 request fails, as it does on SGLang).
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from dataclasses import dataclass
from typing import Any

from backends.sim import tokenizer
from backends.sim.config import SimConfig
from backends.sim.job import ItemSpec


class BadRequest(ValueError):
    """Input SGLang rejects with HTTP 400."""


class PriorityDisabled(BadRequest):
    """A `priority` sent to a server without priority scheduling that aborts such requests
    (`--abort-on-priority-when-disabled`): SGLang aborts it with 503
    (`Scheduler._set_or_validate_priority`, managers/scheduler.py)."""

    status = 503


class InternalError(Exception):
    """Input that makes SGLang's own code raise (an IndexError): HTTP 500, not a 400."""


@dataclass(frozen=True)
class ParsedRequest:
    items: list[ItemSpec]  # what the answer is made of (prompt-major samples for n > 1)
    is_single: bool
    stream: bool
    warmups: list[ItemSpec] = dataclasses.field(default_factory=list)  # n > 1, in order
    rids: list[str] = dataclasses.field(default_factory=list)  # the request's own rids
    priority: int | None = None


def new_rid() -> str:
    """A random 32-hex-digit rid like SGLang's uuid4().hex, without uuid4's getrandom syscall."""
    return f"{random.getrandbits(128):032x}"


def _stop_list(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise BadRequest("stop should be a string or a list of strings.")


def _prompts(body: dict[str, Any]) -> tuple[list[list[int]], list[str | None], bool]:
    """Token ids, texts and is_single (mirrors GenerateReqInput._determine_batch_size)."""
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


def _parallel_sample_num(sp_raw: Any) -> int:
    """n of the request; mirrors GenerateReqInput._handle_parallel_sampling (io_struct.py)."""
    if sp_raw is None:
        return 1
    if isinstance(sp_raw, dict):
        return _as_n(sp_raw.get("n", 1))
    if not isinstance(sp_raw, list) or not sp_raw or not all(isinstance(s, dict) for s in sp_raw):
        raise BadRequest("sampling_params should be a dict or a list of dicts.")
    n = _as_n(sp_raw[0].get("n", 1))
    if any(_as_n(sp.get("n", 1)) != n for sp in sp_raw):
        raise BadRequest("The parallel_sample_num should be the same for all samples in sample params.")
    return n


def _as_n(value: Any) -> int:
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequest("n should be a positive integer.")
    return value


def _obj_field(value: Any, i: int, batch: int, name: str) -> Any:
    """`obj[i]` of a batch field that a list repeats per sample (`list * n`).

    mirrors GenerateReqInput._normalize_batch_inputs + __getitem__ (io_struct.py): SGLang
    checks no length; a list shorter than the batch raises IndexError there (a 500).
    """
    if not isinstance(value, list):
        return value
    if len(value) < batch:
        raise InternalError(f"list index out of range ({name})")
    return value[i]


def _logprob_field(value: Any, default: Any, n: int, name: str) -> Any:
    """mirrors _normalize_logprob_params (io_struct.py): no list with n > 1."""
    if value is None:
        return default
    if isinstance(value, list) and n > 1:
        raise BadRequest(f"Cannot use list {name} with parallel_sample_num > 1")
    return value


def _batch_rids(rid: Any, num: int, batch: int) -> list[str]:
    """mirrors GenerateReqInput._normalize_rid + _validate_rid_uniqueness (io_struct.py)."""
    if rid is None:
        return [new_rid() for _ in range(num)]
    if isinstance(rid, str):
        return [f"{rid}_{i}" for i in range(num)]
    if isinstance(rid, list) and all(isinstance(r, str) for r in rid):
        if len(rid) != batch:
            raise BadRequest(
                "The specified rids length mismatch with the batch_size for batch processing.")
        duplicates = [r for r, count in Counter(rid).items() if count > 1]
        if duplicates:
            raise BadRequest(f"Duplicate request IDs detected within the request: {duplicates}")
        return list(rid)
    raise BadRequest("The rid should be a string or a list of strings.")


def _batch_rooms(value: Any, num: int) -> Any:
    """A scalar room becomes `room + i` for every item, a list stays (it is repeated per
    sample); mirrors GenerateReqInput._normalize_bootstrap_params (io_struct.py)."""
    if value is None or isinstance(value, list):
        return value
    room = _as_room(value)
    return [room + i for i in range(num)]


def _as_room(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
        raise BadRequest("bootstrap_room should be an integer in [0, 2**63).")
    return value


def _as_port(value: Any) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise BadRequest("bootstrap_port should be an integer.") from None


def _as_rank(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{name} should be an integer.")
    return value


def _routed_dp_rank(body: dict[str, Any], config: SimConfig) -> int | None:
    """The external DP rank, validated like TokenizerManager.generate_request.

    mirrors GenerateReqInput.normalize_batch_and_arguments (io_struct.py: the deprecated
    `data_parallel_rank` alias) and TokenizerManager.generate_request's range check
    (managers/tokenizer_manager.py): a ValueError, which the HTTP layer answers with 400.
    """
    rank = _as_rank(body.get("routed_dp_rank"), "routed_dp_rank")
    if rank is None:
        rank = _as_rank(body.get("data_parallel_rank"), "data_parallel_rank")
    if rank is None:
        return None
    ranks = config.num_dp_ranks
    if ranks <= 1 and rank == 0:
        return None  # "ignored because num_dp_ranks=1"
    if rank < 0 or rank >= ranks:
        raise BadRequest(f"routed_dp_rank={rank} out of range [0, {ranks})")
    return rank


def _sample_key(sp: dict[str, Any], rid: str) -> bytes | None:
    """What makes a sampled generation differ: its rid, or its sampling_seed.

    None (greedy) when temperature is absent or ~0 or top_k is 1 (SamplingParams treats
    temperature < 1e-6 as top_k = 1, sampling/sampling_params.py). SGLang's default
    temperature is 1.0; the sim keeps an absent temperature greedy so outputs stay
    comparable across servers (docs/SIMULATOR.md).
    """
    temperature = sp.get("temperature")
    if not isinstance(temperature, (int, float)) or temperature < 1e-6 or sp.get("top_k") == 1:
        return None
    seed = sp.get("sampling_seed")
    if isinstance(seed, int) and not isinstance(seed, bool):
        return _SEED_KEY + seed.to_bytes(8, "little", signed=True)
    return _RID_KEY + rid.encode()


_SEED_KEY, _RID_KEY = b"seed:", b"rid:"


def parse_generate(body: Any, config: SimConfig) -> ParsedRequest:
    """Normalize a native /generate body (GenerateReqInput.normalize_batch_and_arguments)."""
    if not isinstance(body, dict):
        raise BadRequest("The request body should be a JSON object.")
    prompt_ids, prompt_texts, single = _prompts(body)
    priority = _priority(body.get("priority"), config)
    sp_raw = body.get("sampling_params")
    n = _parallel_sample_num(sp_raw)
    if n > 1:
        single = False  # _handle_parallel_sampling turns a single prompt into a batch of one
    batch = len(prompt_ids)
    num = batch * n
    routed = _routed_dp_rank(body, config)
    common = {
        "stream": bool(body.get("stream", False)), "routed_dp_rank": routed,
        "disagg_prefill_dp_rank": _as_rank(body.get("disagg_prefill_dp_rank"),
                                           "disagg_prefill_dp_rank"),
    }
    logprob = _logprob_field(body.get("return_logprob"), False, n, "return_logprob")
    start_len = _logprob_field(body.get("logprob_start_len"), -1, n, "logprob_start_len")
    top_n = _logprob_field(body.get("top_logprobs_num"), 0, n, "top_logprobs_num")
    if single:
        rid = body.get("rid")
        rid = new_rid() if rid is None else rid
        if not isinstance(rid, str):
            raise BadRequest("The rid should be a string for a single request.")
        rids = [rid]
        room, host, port = body.get("bootstrap_room"), body.get("bootstrap_host"), body.get("bootstrap_port")
        if isinstance(room, list):  # the sim's reading of a one-prompt room list
            room = room[0] if len(room) == 1 else _as_room(room)
    else:
        rids = _batch_rids(body.get("rid"), num, batch)
        room, host, port = (_batch_rooms(body.get("bootstrap_room"), num),
                            body.get("bootstrap_host"), body.get("bootstrap_port"))
    prompts = []
    for i in range(batch):
        sp = (sp_raw if single else _obj_field(sp_raw, i, batch, "sampling_params")) or {}
        prompts.append(_item(
            config, i, rids[i], prompt_ids[i], prompt_texts[i], sp,
            logprob=_obj_field(logprob, i, batch, "return_logprob"),
            start_len=_obj_field(start_len, i, batch, "logprob_start_len"),
            top_n=_obj_field(top_n, i, batch, "top_logprobs_num"),
            room=_as_room(_obj_field(room, i, batch, "bootstrap_room")),
            host=_obj_field(host, i, batch, "bootstrap_host"),
            port=_as_port(_obj_field(port, i, batch, "bootstrap_port")), **common))
    stream = common["stream"]
    if n == 1:
        return ParsedRequest(items=prompts, is_single=single, stream=stream, rids=rids,
                             priority=priority)
    warmups, samples = expand_parallel_samples(prompts, n)
    return ParsedRequest(items=samples, is_single=False, stream=stream, warmups=warmups,
                         rids=rids, priority=priority)


def _priority(value: Any, config: SimConfig) -> int | None:
    """mirrors TokenizerManager._set_default_priority and Scheduler._set_or_validate_priority."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) \
            or not -(1 << 63) <= value < (1 << 63):
        raise BadRequest("priority must be a signed 64-bit integer between "
                         "-9223372036854775808 and 9223372036854775807")
    if not config.enable_priority_scheduling and config.abort_on_priority_when_disabled:
        raise PriorityDisabled("Using priority is disabled for this server. Please send a new "
                               "request without a priority.")
    return value


def _item(config: SimConfig, index: int, rid: str, ids: list[int], text: str | None,
          sp: dict[str, Any], *, logprob: Any, start_len: Any, top_n: Any, room: int | None,
          host: Any, port: int | None, **common: Any) -> ItemSpec:
    if not isinstance(sp, dict):
        raise BadRequest("sampling_params should be a dict or a list of dicts.")
    if not ids:
        raise BadRequest("The input prompt is empty.")
    max_new = sp.get("max_new_tokens")
    max_new = config.default_max_new_tokens if max_new is None else max_new
    if not isinstance(max_new, int) or max_new < 0:
        raise BadRequest("max_new_tokens must be a non-negative integer.")
    context = config.context_length
    # mirrors TokenizerManager._validate_one_request (without --allow-auto-truncate): the
    # input must be shorter than the context, and input + an explicit max_new_tokens fit it
    if len(ids) >= context:
        raise BadRequest(f"The input ({len(ids)} tokens) is longer than the model's "
                         f"context length ({context} tokens).")
    # mirrors the scheduler's validate_input_length (managers/utils.py): a tighter bound
    if len(ids) >= config.max_req_input_len:
        raise BadRequest(f"Input length ({len(ids)} tokens) exceeds the maximum allowed "
                         f"length ({config.max_req_input_len} tokens). Use a shorter input "
                         "or enable --allow-auto-truncate.")
    if sp.get("max_new_tokens") is not None and max_new + len(ids) > context:
        raise BadRequest(
            f"Requested token count exceeds the model's maximum context length of {context} "
            f"tokens. You requested a total of {max_new + len(ids)} tokens: {len(ids)} tokens "
            f"from the input messages and {max_new} tokens for the completion. Please reduce "
            "the number of tokens in the input messages or the completion to fit within the "
            "limit.")
    return ItemSpec(
        index=index, rid=rid, input_ids=ids, text=text,
        max_new_tokens=min(max_new, config.context_length - len(ids)),
        stop=_stop_list(sp.get("stop")), stop_token_ids=frozenset(sp.get("stop_token_ids") or ()),
        return_logprob=bool(logprob), logprob_start_len=-1 if start_len is None else int(start_len),
        top_logprobs_num=int(top_n or 0), bootstrap_host=host, bootstrap_port=port,
        bootstrap_room=room, sample_key=_sample_key(sp, rid), **common)


def expand_parallel_samples(prompts: list[ItemSpec], n: int) -> tuple[list[ItemSpec], list[ItemSpec]]:
    """The warm-ups and the samples of an n > 1 request.

    mirrors TokenizerManager._handle_batch_request (managers/tokenizer_manager.py): per
    prompt a warm-up copy with a regenerated rid, max_new_tokens 0 and stream False, then
    n copies with regenerated rids, appended prompt after prompt; every copy keeps the
    prompt's bootstrap room (obj[i].bootstrap_room).
    """
    warmups = [dataclasses.replace(p, rid=new_rid(), max_new_tokens=0, stream=False,
                                   sample_key=None) for p in prompts]
    samples = []
    for p in prompts:
        for _ in range(n):
            rid = new_rid()
            key = p.sample_key
            if key is not None and key.startswith(_RID_KEY):
                key = _RID_KEY + rid.encode()  # each sample draws its own text
            samples.append(dataclasses.replace(p, index=len(samples), rid=rid, sample_key=key))
    return warmups, samples


_PD_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room", "rid", "routed_dp_rank",
              "data_parallel_rank", "disagg_prefill_dp_rank")


def openai_to_generate(body: dict[str, Any], prompt: Any, max_tokens: Any,
                       logprobs: bool, top_logprobs: int, logprob_start_len: int) -> dict[str, Any]:
    """The GenerateReqInput an OpenAI request becomes (serving_*.py)."""
    stop = body.get("stop")
    sampling = {
        "max_new_tokens": max_tokens, "stop": stop, "n": body.get("n", 1) or 1,
        "stop_token_ids": body.get("stop_token_ids"), "ignore_eos": body.get("ignore_eos", False),
        "temperature": body.get("temperature"), "top_k": body.get("top_k"),
        "sampling_seed": body.get("seed"),
    }
    key = "text" if isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt and isinstance(prompt[0], str)) else "input_ids"
    out = {key: prompt, "sampling_params": sampling, "return_logprob": logprobs,
           "top_logprobs_num": top_logprobs, "logprob_start_len": logprob_start_len,
           "stream": bool(body.get("stream", False)), "priority": body.get("priority")}
    out.update({k: body[k] for k in _PD_FIELDS if body.get(k) is not None})
    return out
