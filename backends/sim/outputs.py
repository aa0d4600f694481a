"""SGLang's native output dict of one item (`text`, `output_ids`, `meta_info`).

The OpenAI formatters read the same pieces, as SGLang's serving_*.py read
the native output of the tokenizer manager.
"""

from __future__ import annotations

from typing import Any

from backends.sim import tokenizer
from backends.sim.job import Job, SimError

Triple = list[Any]  # [logprob, token_id, text-or-None]


def error_finish(error: SimError) -> dict[str, Any]:
    """How SGLang reports a failed item inside a stream (FINISH_ABORT.to_json)."""
    return {"type": "abort", "message": error.message, "status_code": error.status,
            "err_type": None}


def input_logprobs(job: Job, mode: str) -> list[Triple]:
    """Prompt logprobs from `logprob_start_len` on; a decode server has none (P holds them)."""
    spec = job.spec
    if mode == "decode" or not spec.return_logprob:
        return []
    start = len(spec.input_ids) if spec.logprob_start_len < 0 else spec.logprob_start_len
    ids = spec.input_ids
    return [[tokenizer.input_logprob(ids, i), ids[i], None] for i in range(start, len(ids))]


def input_top_logprobs(job: Job, mode: str) -> list[Any]:
    return [None if lp is None else [[lp, tok, None]] for lp, tok, _ in input_logprobs(job, mode)]


def output_logprobs(job: Job, start: int = 0) -> list[Triple]:
    return [[lp, tok, None] for lp, tok in
            zip(job.output_logprobs[start:], job.output_ids[start:], strict=True)]


def output_top_logprobs(job: Job, start: int = 0) -> list[list[Triple]]:
    k = job.spec.top_logprobs_num
    return [[[lp, tok, None] for lp, tok in tokenizer.top_logprobs(job.seed, pos, k)]
            for pos in range(start, len(job.output_ids))]


def finish_reason(job: Job) -> dict[str, Any] | None:
    if job.error is not None:
        return error_finish(job.error)
    return job.finish_reason


def native_output(job: Job, mode: str, index: int | None = None) -> dict[str, Any]:
    """One `/generate` result (or stream chunk: cumulative text so far)."""
    meta: dict[str, Any] = {
        "id": job.spec.rid,
        "finish_reason": finish_reason(job),
        "prompt_tokens": job.prompt_tokens,
        "weight_version": "default",
        "num_retractions": 0,
    }
    if job.spec.return_logprob:
        meta["input_token_logprobs"] = input_logprobs(job, mode)
        meta["output_token_logprobs"] = output_logprobs(job)
        if job.spec.top_logprobs_num > 0:
            meta["input_top_logprobs"] = input_top_logprobs(job, mode)
            meta["output_top_logprobs"] = output_top_logprobs(job)
    meta["reasoning_tokens"] = 0
    meta["completion_tokens"] = len(job.output_ids)
    meta["cached_tokens"] = job.cached_tokens
    if job.done and job.finished_at is not None:
        meta["e2e_latency"] = round(job.finished_at - job.created, 6)
    out: dict[str, Any] = {"text": job.text, "output_ids": list(job.output_ids), "meta_info": meta}
    if index is not None:
        out["index"] = index
    return out


def usage(jobs: list[Job], n: int, cache_report: bool) -> dict[str, Any]:
    """UsageInfo: prompt and cached tokens counted once per prompt, not per sample."""
    firsts = jobs[::n] if n > 0 else jobs
    prompt = sum(j.prompt_tokens for j in firsts)
    completion = sum(len(j.output_ids) for j in jobs)
    details = {"cached_tokens": sum(j.cached_tokens for j in firsts)} if cache_report else None
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
            "completion_tokens": completion, "prompt_tokens_details": details,
            "reasoning_tokens": 0, "completion_tokens_details": None}
