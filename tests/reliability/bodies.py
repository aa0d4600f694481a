"""Malformed request bodies for the fuzz test, generated from a fixed seed.

Four families: random bytes; deeply nested JSON (in the body and inside a field); bodies over
the size limit; and a valid request of each endpoint with one field replaced by a value of a
wrong type, for every field the endpoints read.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import orjson

GENERATE = {"text": "fuzz", "sampling_params": {"max_new_tokens": 4, "temperature": 0.0},
            "stream": False, "return_logprob": False}
CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "fuzz"}],
        "max_tokens": 4, "temperature": 0.0, "stream": False, "n": 1}
COMPLETIONS = {"model": "sim-model", "prompt": "fuzz", "max_tokens": 4, "stream": False,
               "echo": False, "logprobs": None, "n": 1}
TEMPLATES = {"/generate": GENERATE, "/v1/chat/completions": CHAT, "/v1/completions": COMPLETIONS}

# Fields whose wrong-typed values are tried, as paths into the template.
FIELDS = {
    "/generate": [("text",), ("input_ids",), ("sampling_params",),
                  ("sampling_params", "max_new_tokens"), ("sampling_params", "temperature"),
                  ("sampling_params", "n"), ("sampling_params", "stop"), ("stream",),
                  ("return_logprob",), ("rid",), ("bootstrap_room",), ("lora_path",)],
    "/v1/chat/completions": [("model",), ("messages",), ("messages", 0),
                             ("messages", 0, "role"), ("messages", 0, "content"),
                             ("max_tokens",), ("temperature",), ("stream",), ("n",),
                             ("stop",), ("stream_options",), ("tools",)],
    "/v1/completions": [("model",), ("prompt",), ("max_tokens",), ("stream",), ("echo",),
                        ("logprobs",), ("n",), ("stop",), ("suffix",)],
}
WRONG = [None, True, -1, 0, 1.5, "x", "", [], [1, "a"], [[]], {}, {"k": 1},
         [{"type": "text", "text": 5}], 18446744073709551616]
BIG = "__big_int__"  # placeholder orjson can encode


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: bytes
    must_reject: bool  # never valid: 4xx; otherwise 200 is fine when the value is acceptable


def _replace(template: dict, path: tuple, value: object) -> dict:
    body = orjson.loads(orjson.dumps(template))
    target = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return body


def _encode(template: dict, path: tuple, value: object) -> bytes:
    """The template with one field replaced; ints beyond 64 bits are spliced in as text."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 2**64:
        raw = orjson.dumps(_replace(template, path, BIG))
        return raw.replace(orjson.dumps(BIG), str(value).encode())
    return orjson.dumps(_replace(template, path, value))


def random_bytes(rng: random.Random, count: int) -> Iterator[Case]:
    paths = list(TEMPLATES)
    for i in range(count):
        size = rng.choice([0, 1, 2, 7, 64, 500, 4000])
        yield Case(f"bytes-{i}", rng.choice(paths), rng.randbytes(size), True)


def deep_json() -> Iterator[Case]:
    """Nesting below orjson's parse limit (1024) is valid JSON, above it is not."""
    for depth in (600, 1100, 10_000, 200_000):
        for path in TEMPLATES:
            yield Case(f"deep-array-{depth}{path}", path, b"[" * depth + b"]" * depth, True)
            yield Case(f"deep-object-{depth}{path}", path,
                       b'{"a":' * depth + b"1" + b"}" * depth, True)
        nested = b"[" * depth + b"]" * depth
        yield Case(f"deep-field-{depth}", "/generate",
                   b'{"text": "deep", "sampling_params": {"stop": ' + nested + b"}}", True)
        yield Case(f"deep-messages-{depth}", "/v1/chat/completions",
                   b'{"messages": [{"role": "user", "content": ' + nested + b"}]}", True)


def truncated(rng: random.Random) -> Iterator[Case]:
    """Valid bodies cut at random places, and valid JSON of the wrong shape."""
    for path, template in TEMPLATES.items():
        raw = orjson.dumps(template)
        for cut in sorted(rng.sample(range(1, len(raw)), 5)):
            yield Case(f"cut-{cut}{path}", path, raw[:cut], True)
        for value in (b"null", b"1", b'"text"', b"[]", b"[{}]", b"{}", b"\xef\xbb\xbf{}"):
            yield Case(f"shape-{value.decode(errors='replace')}{path}", path, value, True)


def wrong_types() -> Iterator[Case]:
    for path, fields in FIELDS.items():
        for field in fields:
            for value in WRONG:
                name = f"{path}:{'.'.join(map(str, field))}={value!r}"[:90]
                yield Case(name, path, _encode(TEMPLATES[path], field, value), False)


def all_cases(seed: int = 20240611) -> list[Case]:
    rng = random.Random(seed)
    return [*random_bytes(rng, 60), *deep_json(), *truncated(rng), *wrong_types()]
