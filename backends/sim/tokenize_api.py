"""`/v1/tokenize` and `/v1/detokenize` (and the unversioned aliases), in SGLang's shapes.

mirrors OpenAIServingTokenize / OpenAIServingDetokenize (entrypoints/openai/serving_tokenize.py):
a `prompt` string or list of strings, or chat `messages` rendered as for a chat completion;
the answer carries `tokens`, `count` and the model's `max_model_len`.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from backends.sim import tokenizer
from backends.sim.native import read_json
from backends.sim.requests import BadRequest


def _error(message: str) -> JSONResponse:
    return JSONResponse({"object": "error", "message": message, "type": "BadRequestError",
                         "param": None, "code": 400}, status_code=400)


async def tokenize(request: Request) -> Response:
    config = request.app.state.sim.config
    try:
        body = await read_json(request)
    except BadRequest as exc:
        return _error(str(exc))
    if not isinstance(body, dict):
        return _error("The request body should be a JSON object.")
    prompt: Any = body.get("prompt")
    messages = body.get("messages")
    if messages is not None:
        if not isinstance(messages, list):
            return _error("messages should be a list")
        prompt = tokenizer.render_chat(messages, bool(body.get("continue_final_message")))
    if isinstance(prompt, str):
        tokens: Any = tokenizer.encode(prompt)
        count: Any = len(tokens)
    elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        tokens = [tokenizer.encode(p) for p in prompt]
        count = [len(t) for t in tokens]
    else:
        return _error("Either prompt or messages must be provided")
    return JSONResponse({"tokens": tokens, "count": count,
                         "max_model_len": config.context_length})


async def detokenize(request: Request) -> Response:
    try:
        body = await read_json(request)
    except BadRequest as exc:
        return _error(str(exc))
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(t, int) and t >= 0 for t in tokens):
        return _error("tokens should be a list of non-negative token ids")
    return JSONResponse({"text": tokenizer.decode(tokens)})
