"""The end of a stream whose decode failed after the answer was complete, or its budget
spent: what the client still lacks, made by the gateway.

A decode that dies after its last token (or a stall that is cut there) leaves nothing to
continue, yet the client has not seen the whole stream: the last choice's `finish_reason`
(when the token budget ran out, SGLang's next event would have said "length"), the usage
event a request with `stream_options.include_usage` asked for (or the one the gateway asked
for to count tokens: gateway/observability/answer_tokens.py), and `[DONE]`. Token counts
here are counted in chunks, one token per chunk as SGLang streams them (the same count a
continued stream uses, gateway/dispatch/failover.py); the prompt's are the request's own
(exact when the gateway counted it, else its estimate).
"""

from __future__ import annotations

from gateway.observability.answer_tokens import client_asks_usage, usage_forced
from gateway.request import CHAT, GENERATE, RequestView
from gateway.sse import DONE, frame


def closing_events(view: RequestView, seen: list[dict], finished: bool,
                   generated: int) -> bytes:
    """The events that end the client's stream, [DONE] last."""
    if not seen:
        return DONE
    if view.endpoint == GENERATE:
        return (b"" if finished else frame(_native_final(view, seen))) + DONE
    first = seen[0]
    head = {"id": first.get("id"), "object": first.get("object"),
            "created": first.get("created"), "model": first.get("model")}
    out = []
    if not finished:
        choice = {"index": 0, "delta": {}} if view.endpoint == CHAT else {"index": 0, "text": ""}
        out.append(frame({**head, "choices": [{**choice, "finish_reason": "length"}]}))
    if _wants_usage(view) and not any(isinstance(o.get("usage"), dict) for o in seen):
        prompt = sum(view.lengths) if view.lengths else view.prompt_tokens
        out.append(frame({**head, "choices": [], "usage": {
            "prompt_tokens": prompt, "completion_tokens": generated,
            "total_tokens": prompt + generated}}))
    return b"".join(out) + DONE


def _wants_usage(view: RequestView) -> bool:
    return usage_forced(view) or client_asks_usage(view.body)


def _native_final(view: RequestView, seen: list[dict]) -> dict:
    """The last event again, now with the finish SGLang gives a spent budget
    (`{"type": "length", "length": max_new_tokens}`); empty text and ids when the stream is
    incremental, so nothing is repeated."""
    last = dict(seen[-1])
    meta = dict(last.get("meta_info") or {})
    params = view.body.get("sampling_params")
    budget = params.get("max_new_tokens") if isinstance(params, dict) else None
    meta["finish_reason"] = {"type": "length", "length": budget}
    last["meta_info"] = meta
    first_text = seen[0].get("text") or ""
    if len(seen) > 1 and not (last.get("text") or "").startswith(first_text):
        last["text"], last["output_ids"] = "", []
    return last
