"""Mid-stream failover: a stream whose decode died continues on another pair, seamlessly.

What the client has already received is the state: the continuation request is the original
one plus what was generated, with the remaining token budget, and its stream is spliced into
the client's so that the client sees one well-formed stream (docs/RELIABILITY.md):

* native `/generate` (one prompt): SGLang streams the cumulative `text` and `output_ids`.
  A token-id prompt continues with `input_ids = prompt + output_ids`: greedy decoding gives
  exactly the answer the dead decode would have given. A text prompt continues with
  `text = prompt + generated text` (the boundary may tokenize differently). Spliced chunks
  carry the text and ids before the break in front of their own, `completion_tokens` and the
  id of the original stream.
* chat: the partial answer goes back as a final assistant message with
  `continue_final_message` (SGLang appends it to the prompt without ending the turn).
* completions (a string prompt): `prompt + generated text`.

Sampled continuations are valid samples of the rest of the answer, not the same one. Not
continued (the stream ends with an error event, as before): batches, logprobs, tool calls,
completions with `echo` or token-id prompts. Token counts of a continued chat or completions
stream are counted in chunks (one token per chunk, as SGLang streams them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from gateway.dispatch.stream_end import closing_events
from gateway.request import CHAT, COMPLETIONS, GENERATE, RequestView
from gateway.sse import DONE, NOT_JSON, EventSplitter, frame, parsed


def resumable(view: RequestView) -> bool:
    """Whether a stream of this request can be continued on another pair."""
    body = view.body
    if not view.stream or view.batch_size is not None or view.n != 1:
        return False
    if view.endpoint == GENERATE:
        return not body.get("return_logprob") and isinstance(body.get("sampling_params") or {},
                                                             dict)
    if view.endpoint == CHAT:
        return not (body.get("tools") or body.get("logprobs") or body.get("response_format"))
    return (isinstance(body.get("prompt"), str) and not body.get("echo")
            and body.get("logprobs") is None)


class Continuation:
    """The request that continues a broken stream, and how its events are spliced in."""

    def __init__(self, view: RequestView | None, seen: list[dict]) -> None:
        self.view = view  # None: nothing left to generate, only the end of the stream
        self.seen = seen
        self.generated = 0  # tokens the client already has
        self.prefix_text = ""
        self.prefix_ids: list[int] = []
        self.stream_id: object = None
        self.prompt_tokens: int | None = None
        self._skip_role = view is not None and view.endpoint == CHAT
        self._end = DONE

    # -- building ---------------------------------------------------------------------------

    @classmethod
    def _ended(cls, view: RequestView, seen: list[dict], finished: bool,
               generated: int) -> Continuation:
        """Nothing left to generate: only the end of the stream (`closing`)."""
        cont = cls(None, seen)
        cont._end = closing_events(view, seen, finished, generated)
        return cont

    @classmethod
    def build(cls, view: RequestView, seen: list[dict]) -> Continuation | None:
        """The continuation of `view` after the client received `seen`, or None."""
        if not seen or not resumable(view):
            return None
        builder = {GENERATE: cls._native, CHAT: cls._chat, COMPLETIONS: cls._completion}
        return builder[view.endpoint](view, seen)

    @classmethod
    def _native(cls, view: RequestView, seen: list[dict]) -> Continuation | None:
        last = seen[-1]
        meta = last.get("meta_info") or {}
        text, ids = last.get("text"), last.get("output_ids")
        if not isinstance(text, str) or not isinstance(ids, list):
            return None
        first_text = seen[0].get("text") or ""
        if len(seen) > 1 and not text.startswith(first_text):  # incremental streaming output
            text = "".join(o.get("text") or "" for o in seen)
            ids = [i for o in seen for i in (o.get("output_ids") or [])]
        body = dict(view.body)
        body.pop("rid", None)
        params = dict(body.get("sampling_params") or {})
        finished = _finished(meta.get("finish_reason"))
        if finished or not _spend(params, "max_new_tokens", len(ids), GENERATE_BUDGET):
            return cls._ended(view, seen, finished, len(ids))
        if "min_new_tokens" in params and isinstance(params["min_new_tokens"], int):
            params["min_new_tokens"] = max(0, params["min_new_tokens"] - len(ids))
        body["sampling_params"] = params
        if isinstance(body.get("input_ids"), list):
            body["input_ids"] = body["input_ids"] + ids
        elif isinstance(body.get("text"), str):
            body["text"] = body["text"] + text
        else:
            return None
        cont = cls(_view(view, body, len(ids)), seen)
        cont.generated, cont.prefix_text, cont.prefix_ids = len(ids), text, list(ids)
        cont.stream_id = meta.get("id")
        cont.prompt_tokens = meta.get("prompt_tokens")
        return cont

    @classmethod
    def _chat(cls, view: RequestView, seen: list[dict]) -> Continuation | None:
        parts, count, finished = [], 0, False
        for obj in seen:
            for choice in obj.get("choices") or []:
                delta = choice.get("delta") or {}
                if delta.get("tool_calls") or delta.get("reasoning_content"):
                    return None
                if delta.get("content"):
                    parts.append(delta["content"])
                    count += 1
                finished = finished or _finished(choice.get("finish_reason"))
        body = dict(view.body)
        body.pop("rid", None)
        key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        if finished or not _spend(body, key, count):
            return cls._ended(view, seen, finished, count)
        body["messages"] = list(body["messages"]) + [{"role": "assistant",
                                                      "content": "".join(parts)}]
        body["continue_final_message"] = True
        cont = cls(_view(view, body, count), seen)
        cont.generated = count
        cont.stream_id = seen[0].get("id")
        return cont

    @classmethod
    def _completion(cls, view: RequestView, seen: list[dict]) -> Continuation | None:
        parts, finished = [], False
        for obj in seen:
            for choice in obj.get("choices") or []:
                if choice.get("text"):
                    parts.append(choice["text"])
                finished = finished or _finished(choice.get("finish_reason"))
        body = dict(view.body)
        body.pop("rid", None)
        if finished or not _spend(body, "max_tokens", len(parts), COMPLETIONS_BUDGET):
            return cls._ended(view, seen, finished, len(parts))
        body["prompt"] = body["prompt"] + "".join(parts)
        cont = cls(_view(view, body, len(parts)), seen)
        cont.generated = len(parts)
        cont.stream_id = seen[0].get("id")
        return cont

    # -- splicing -----------------------------------------------------------------------------

    async def splice(self, stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """The continuation's events, rewritten to read as the rest of the original stream."""
        splitter = EventSplitter()
        async for chunk in stream:
            out = []
            for _, payload, obj in parsed(splitter, chunk):
                if payload == b"[DONE]":
                    out.append(DONE)
                    continue
                if obj is NOT_JSON:  # (also no data line)
                    continue
                if isinstance(obj, dict) and "error" not in obj:
                    obj = self._rewrite(obj)
                    if obj is None:
                        continue
                out.append(frame(obj))
            if out:
                yield b"".join(out)

    def _rewrite(self, obj: dict) -> dict | None:
        if self.view.endpoint == GENERATE:
            meta = obj.get("meta_info")
            if isinstance(obj.get("text"), str):
                obj["text"] = self.prefix_text + obj["text"]
            if isinstance(obj.get("output_ids"), list):
                obj["output_ids"] = self.prefix_ids + obj["output_ids"]
            if isinstance(meta, dict):
                meta["completion_tokens"] = int(meta.get("completion_tokens") or 0) \
                    + self.generated
                if self.prompt_tokens is not None:
                    meta["prompt_tokens"] = self.prompt_tokens
                    _cached_within(meta, "cached_tokens", self.prompt_tokens)
                if self.stream_id is not None:
                    meta["id"] = self.stream_id
                finish = meta.get("finish_reason")
                if isinstance(finish, dict) and isinstance(finish.get("length"), int):
                    finish["length"] += self.generated  # the budget was the continuation's
            return obj
        if self.stream_id is not None:
            obj["id"] = self.stream_id
        choices = obj.get("choices") or []
        if self._skip_role and choices:
            delta = choices[0].get("delta") or {}
            if delta.get("role") and not delta.get("content"):
                self._skip_role = False
                return None  # the client already had the role chunk
            self._skip_role = False
        usage = obj.get("usage")
        if isinstance(usage, dict):
            prompt = max(0, int(usage.get("prompt_tokens") or 0) - self.generated)
            completion = int(usage.get("completion_tokens") or 0) + self.generated
            usage.update(prompt_tokens=prompt, completion_tokens=completion,
                         total_tokens=prompt + completion)
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict):
                _cached_within(details, "cached_tokens", prompt)
        return obj

    def closing(self) -> bytes:
        """The end of a stream that had nothing left to generate when its decode failed:
        its missing finish and usage events (gateway/dispatch/stream_end.py), [DONE]."""
        return self._end


def _cached_within(figures: dict, key: str, prompt: int) -> None:
    """The continuation's server counted its cached prefix over the prompt AND the text
    generated before the break; of the original prompt that prefix covers at most all of it
    (a cached count above the prompt count read as negative uncached tokens, 2026-12-07)."""
    cached = figures.get(key)
    if isinstance(cached, int) and not isinstance(cached, bool) and cached > prompt:
        figures[key] = prompt


def _finished(reason: object) -> bool:
    return reason is not None and reason != ""


# The budget SGLang gives a request that names none: `SamplingParams.max_new_tokens` (128) for
# `/generate`, `CompletionRequest.max_tokens` (16) for completions; a chat's is the context
# left (`ChatCompletionRequest.max_tokens` None), which the continuation's server computes.
GENERATE_BUDGET = 128
COMPLETIONS_BUDGET = 16


def _spend(params: dict, key: str, used: int, default: int | None = None) -> bool:
    """Take `used` tokens off the budget `params[key]` (`default` when the request named
    none: the continuation names it, or its server would grant its default once more and
    the client would get more tokens than it was owed); False if nothing is left."""
    budget = params.get(key)
    if budget is None:
        budget = default
    if isinstance(budget, int) and not isinstance(budget, bool):
        if budget - used <= 0:
            return False
        params[key] = budget - used
    return True


def _view(view: RequestView, body: dict, generated: int) -> RequestView:
    return dataclasses.replace(view, body=body, rids=None, routing_tokens=(
        tuple(body["input_ids"]) if view.routing_tokens is not None
        and isinstance(body.get("input_ids"), list) else view.routing_tokens),
        prompt_tokens=view.prompt_tokens + generated)


def error_end(error) -> bytes:
    return frame(error.body()) + DONE
