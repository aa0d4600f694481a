"""Pre-dispatch context check: a request that cannot fit the model's context gets a 400 at
once, naming the numbers, instead of going to both legs to fail there.

The rule is SGLang's (`TokenizerManager._validate_one_request`, without auto-truncation): the
prompt must be shorter than the context length, and prompt + an explicit `max_new_tokens`
(`max_tokens`, `max_completion_tokens`) must fit it. The context length is the servers'
(`/v1/models` `max_model_len`, learned by the probe), of the request's model's servers.

Counting tokens costs nothing for token-id prompts or a view already counted
(`view.lengths`, gateway/tokens/prompt_tokens.py). Otherwise a cheap upper bound decides whether
to look closer (`most_tokens`: a token covers at least one byte of text): only a prompt
whose bound comes within `NEAR` of the limit is counted exactly, by the served model's
tokenizer when it is loaded here, else by one server's
`/v1/tokenize` (a short, bounded call; the chat template included for chat). If that fails,
the request goes on and the servers decide.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import httpx
import orjson

from gateway.errors import BadRequest
from gateway.request import CHAT, COMPLETIONS, GENERATE, RequestView

NEAR = 0.5  # estimates above this share of the context are counted exactly
TOKENIZE_TIMEOUT = 2.0


def requested_new_tokens(view: RequestView) -> int | None:
    """The explicit output budget of the request (per item), if it sets one."""
    body = view.body
    if view.endpoint == GENERATE:
        params = body.get("sampling_params")
        if isinstance(params, list):
            params = params[0] if params else {}
        value = (params or {}).get("max_new_tokens")
    elif view.endpoint == CHAT:
        value = body.get("max_completion_tokens", body.get("max_tokens"))
    else:
        value = body.get("max_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _bytes(text: object) -> int:
    if not isinstance(text, str):
        return 0
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def most_tokens(view: RequestView) -> int:
    """An upper bound of the longest prompt's tokens, without a tokenizer: a token covers at
    least one byte of text (byte-level BPE at worst; SentencePiece pieces too), plus a few per
    chat message for the template's markers. (The characters/4 estimate is far below the
    truth for CJK text, 1-3 tokens a character, so it cannot decide to skip the count.)"""
    body = view.body
    if view.endpoint == CHAT:
        total = 0
        for message in body.get("messages") or ():
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):
                total += sum(_bytes(p.get("text")) for p in content if isinstance(p, dict))
            else:
                total += _bytes(content)
            total += 8
        return total
    prompt = body.get("text") if view.endpoint == GENERATE else body.get("prompt")
    if isinstance(prompt, list):
        return max((_bytes(p) for p in prompt), default=0)
    return _bytes(prompt) if prompt is not None else view.prompt_tokens


class ContextCheck:
    def __init__(self, models, client: httpx.AsyncClient | None, tokens=None) -> None:
        self.models = models  # gateway/scheduling/models.py: the request's model and its servers
        self.client = client
        self.tokens = tokens  # prompt_tokens.PromptTokens: the served model's tokenizer, if any

    def context_length(self, view: RequestView) -> int | None:
        """The least context length of the model's usable prefill servers (None: unknown)."""
        least = None
        for server in self.models.of(view).servers["prefill"]:
            context = server.context_length
            if context and (least is None or context < least) and server.usable:
                least = context
        return least

    def check(self, view: RequestView) -> Coroutine[Any, Any, None] | None:
        """Raise BadRequest if `view` cannot fit; None when that is settled here, else the
        coroutine to await that counts the prompt exactly first (a prompt near the limit):
        the usual request makes no coroutine."""
        context = self.context_length(view)
        if context is None:
            return None
        new = requested_new_tokens(view)
        if view.lengths is None:
            if most_tokens(view) + (new or 0) < NEAR * context:
                return None
            return self._check_counted(view, context, new)
        _fits(view.lengths, context, new)
        return None

    async def _check_counted(self, view: RequestView, context: int, new: int | None) -> None:
        lengths = None
        if self.tokens is not None:
            lengths = (await self.tokens.count(view, needed=True)).lengths
        if lengths is None:
            lengths = await self._count(view)
        if lengths is not None:
            _fits(lengths, context, new)

    async def _count(self, view: RequestView) -> list[int] | None:
        """Exact prompt lengths from a server's own tokenizer, or None if it cannot say."""
        body = self._tokenize_body(view)
        if body is None or self.client is None:
            return None
        model = self.models.of(view)
        for server in model.usable("decode") + model.usable("prefill"):
            try:
                async with asyncio.timeout(TOKENIZE_TIMEOUT):
                    response = await self.client.post(server.url + "/v1/tokenize",
                                                      content=orjson.dumps(body))
                if response.status_code != 200:
                    continue
                count = response.json().get("count")
            except (httpx.HTTPError, TimeoutError, ValueError, AttributeError):
                continue
            if isinstance(count, int):
                return [count]
            if isinstance(count, list) and all(isinstance(c, int) for c in count):
                return count
        return None

    @staticmethod
    def _tokenize_body(view: RequestView) -> dict[str, Any] | None:
        body = view.body
        if view.endpoint == CHAT:
            out = {"messages": body["messages"]}
            for key in ("tools", "chat_template_kwargs", "continue_final_message"):
                if body.get(key) is not None:
                    out[key] = body[key]
            return out
        prompt = body.get("text") if view.endpoint == GENERATE else body.get("prompt")
        if view.endpoint == COMPLETIONS or isinstance(prompt, (str, list)):
            if isinstance(prompt, str) or (isinstance(prompt, list)
                                           and all(isinstance(p, str) for p in prompt)):
                return {"prompt": prompt}
        return None


def _fits(lengths, context: int, new: int | None) -> None:
    """Raise BadRequest naming the numbers when a prompt (plus the new tokens) cannot fit."""
    for prompt in lengths:
        if prompt >= context:
            raise BadRequest(f"the prompt has {prompt} tokens, and the model's context "
                             f"length is {context} tokens: it does not fit",
                             code="context_length_exceeded")
        if new is not None and prompt + new > context:
            raise BadRequest(f"the prompt has {prompt} tokens and {new} new tokens were "
                             f"asked for: {prompt + new} tokens do not fit the model's "
                             f"context length of {context} tokens",
                             code="context_length_exceeded")
