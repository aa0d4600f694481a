"""The soak's requests and the invariant every answer must meet.

Each request asks for a known number of tokens (`max_tokens`/`max_new_tokens` with
`ignore_eos`), so a complete answer is checkable: status 200, a body that parses (every
`data:` line of a stream, no error event, exactly one `data: [DONE]`), `n` choices each
finished by length, and exactly the asked completion tokens. `check` returns None for a
good answer, else (failure kind, detail).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

KINDS = ("chat", "chat_stream", "completion", "completion_stream", "generate",
         "generate_stream", "completion_n2", "chat_n2_stream")
MODEL = "sim-model"


@dataclass(frozen=True)
class Request:
    kind: str
    path: str
    body: dict[str, Any]
    stream: bool
    tokens: int  # completion tokens asked per choice
    n: int


def make_request(rng: random.Random, number: int) -> Request:
    """The `number`-th request of a run: its kind, prompt and length come from `rng`."""
    kind = rng.choice(KINDS)
    tokens = rng.randint(2, 12)
    prompt = f"soak request {number}: " + " ".join(rng.choice(_WORDS) for _ in range(12))
    stream = kind.endswith("_stream")
    n = 2 if "_n2" in kind else 1
    if kind.startswith("generate"):
        body: dict[str, Any] = {"text": prompt, "stream": stream, "sampling_params": {
            "max_new_tokens": tokens, "ignore_eos": True, "temperature": 0.7}}
        return Request(kind, "/generate", body, stream, tokens, 1)
    body = {"model": MODEL, "max_tokens": tokens, "ignore_eos": True, "stream": stream, "n": n,
            "temperature": 0.7}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if kind.startswith("chat"):
        body["messages"] = [{"role": "user", "content": prompt}]
        return Request(kind, "/v1/chat/completions", body, stream, tokens, n)
    body["prompt"] = prompt
    return Request(kind, "/v1/completions", body, stream, tokens, n)


_WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india",
          "juliet", "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo")

Failure = tuple[str, str]


def check(request: Request, status: int, body: bytes) -> Failure | None:
    """None if the answer meets the invariant, else (kind, detail)."""
    if status != 200:
        return f"status_{status}", _excerpt(body)
    if request.stream:
        return _check_stream(request, body)
    try:
        payload = json.loads(body)
    except ValueError:
        return "malformed_json", _excerpt(body)
    if request.kind.startswith("generate"):
        return _check_native(request, payload)
    return _check_openai(request, payload, payload.get("usage"), payload.get("choices"))


def _check_native(request: Request, payload: Any) -> Failure | None:
    meta = payload.get("meta_info") if isinstance(payload, dict) else None
    if not isinstance(meta, dict):
        return "malformed_answer", _excerpt(json.dumps(payload).encode())
    finish = (meta.get("finish_reason") or {}).get("type")
    if meta.get("completion_tokens") != request.tokens or finish != "length":
        return "token_count", (f"asked {request.tokens}, got {meta.get('completion_tokens')} "
                               f"(finish {finish})")
    return None


def _check_openai(request: Request, payload: Any, usage: Any, choices: Any) -> Failure | None:
    if not isinstance(payload, dict) or not isinstance(choices, list):
        return "malformed_answer", _excerpt(json.dumps(payload).encode())
    if len(choices) != request.n:
        return "choices", f"asked n={request.n}, got {len(choices)} choices"
    reasons = [c.get("finish_reason") for c in choices]
    if any(r != "length" for r in reasons):
        return "token_count", f"finish reasons {reasons}"
    got = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if got != request.tokens * request.n:
        return "token_count", f"asked {request.n}x{request.tokens}, usage says {got}"
    return None


def _check_stream(request: Request, body: bytes) -> Failure | None:
    lines = [line for line in body.decode(errors="replace").split("\n")
             if line.startswith("data:")]
    done = [line for line in lines if line.strip() == "data: [DONE]"]
    if len(done) != 1 or lines[-1].strip() != "data: [DONE]":
        return "done_count", f"{len(done)} [DONE] lines; last line {_excerpt(lines[-1:])}"
    events = []
    for line in lines[:-1]:
        try:
            events.append(json.loads(line[len("data:"):]))
        except ValueError:
            return "malformed_sse", _excerpt(line.encode())
    errors = [e for e in events if not isinstance(e, dict) or "error" in e]
    if errors:
        return "error_event", _excerpt(json.dumps(errors[0]).encode())
    if not events:
        return "malformed_sse", "no events before [DONE]"
    if request.kind.startswith("generate"):
        found = _check_native(request, events[-1])
    else:
        found = _check_openai_stream(request, events)
    if found is None:
        return None
    return found[0], f"{found[1]}; {len(events)} events, the last: {_excerpt(lines[-3:-1])}"


def _check_openai_stream(request: Request, events: list[dict]) -> Failure | None:
    finished: dict[int, list[str]] = {}
    usage = None
    for event in events:
        usage = event.get("usage") or usage
        for choice in event.get("choices") or []:
            if choice.get("finish_reason") is not None:
                finished.setdefault(choice.get("index", 0), []).append(choice["finish_reason"])
    if sorted(finished) != list(range(request.n)):
        return "choices", f"asked n={request.n}, finished choices {sorted(finished)}"
    if any(reasons != ["length"] for reasons in finished.values()):
        return "token_count", f"finish reasons {finished}"
    got = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if got != request.tokens * request.n:
        return "token_count", f"asked {request.n}x{request.tokens}, usage says {got}"
    return None


def _excerpt(data: bytes | list[str], head: int = 300, tail: int = 200) -> str:
    """The start and the end of `data` (an upstream's reason is often at the end)."""
    text = data.decode(errors="replace") if isinstance(data, bytes) else " ".join(data)
    if len(text) <= head + tail:
        return text
    return f"{text[:head]} ...({len(text)} chars)... {text[-tail:]}"
