"""Pre-dispatch context check: a request that cannot fit the model's context gets a 400 at
once, naming the numbers, instead of going to both legs to fail there; no prompt over the
limit is forwarded.

The rules are SGLang's, without auto-truncation:
* `TokenizerManager._validate_one_request`: the prompt must be shorter than the context
  length, and prompt + an explicit `max_new_tokens` (`max_tokens`, `max_completion_tokens`)
  must fit it;
* the scheduler's `validate_input_length`: the prompt must be shorter than the server's
  `max_req_input_len` (`TpModelWorker`: the context length or the KV pool, whichever is
  smaller, less 1, less 5), a tighter bound: a prompt 5 tokens short of the context passed
  the first rule, went to both legs, and the prefill refused it.
Both numbers are the servers' (`/v1/models` `max_model_len` and `/server_info`
`max_req_input_len`, learned by the probe), the least among the request's model's servers.

Token-id prompts, and a view already counted (`view.lengths`), are checked as they are.
Otherwise the prompt's size decides first, without tokenizing (docs/RELIABILITY.md, "Context
check"):
* over, proven by bytes: with the served model's tokenizer here, no token stands for more than
  `PromptTokens.token_bytes` bytes of text, so a prompt of more characters than context x that
  has more tokens than the context (`fewest_tokens`): 400, nothing tokenized (a 30 MiB body is
  refused in microseconds);
* within, proven by bytes: a token covers at least one byte, so a prompt whose byte bound
  (`most_tokens`, at most the body's own size) stays under `NEAR` of the limit fits: passed;
* in between, counted exactly: by the served model's tokenizer when it is here, else by one
  server's `/v1/tokenize` (chat template included), the servers asked in turn
  (`ask_in_turn.InTurn`, as count_tokens asks them: rotated, a silent one hedged after a
  second) within a deadline that grows with the prompt. When nothing could count it (no
  tokenizer for it, no server answered in time), the request is refused with 503 and
  Retry-After (`CountUnavailable`), never forwarded unchecked.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Coroutine
from typing import Any, NamedTuple

import httpx
import orjson

from gateway.errors import BadRequest, ServiceUnavailable
from gateway.request import CHAT, COMPLETIONS, GENERATE, MESSAGES, RESPONSES, RequestView
from gateway.responses.view import messages_of
from gateway.servers.pool import Server
from gateway.tokens.ask_in_turn import InTurn, NoAnswer

NEAR = 0.5  # estimates above this share of the context are counted exactly
TOKENIZE_TIMEOUT = 2.0  # seconds for /v1/tokenize of a short prompt, plus a second per 4 MiB
RETRY_AFTER = "2"
SLICE = 1 << 20  # a large prompt goes to /v1/tokenize in slices of this many bytes
SCAN_WINDOW = 64 << 10  # bytes of the answer kept from one read to the next while scanning
# `"count": N` or a batch's `"count": [N, ...]`, whole (the delimiter after it has arrived)
_COUNT = re.compile(rb'"count"\s*:\s*(\d+(?=[\s,}])|\[[\d\s,]*\])')


class Limits(NamedTuple):
    """What a request's model takes: `context` tokens of prompt + new tokens, and prompts of
    fewer than `prompt` tokens (at most `context`)."""

    context: int
    prompt: int


class CountUnavailable(ServiceUnavailable):
    """A prompt near the context limit that nothing could count: refused, not forwarded."""


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


def _bytes(text: object, cap: int) -> int:
    """At least the UTF-8 size of `text`: exact for ASCII, else 4 a character, at most `cap`
    (the body's size, which holds the text; 0: no cap). No copy of the text is made."""
    if not isinstance(text, str):
        return 0
    if text.isascii():
        return len(text)
    return min(4 * len(text), cap) if cap else 4 * len(text)


def most_tokens(view: RequestView) -> int:
    """An upper bound of the longest prompt's tokens, without a tokenizer: a token covers at
    least one byte of text (byte-level BPE at worst; SentencePiece pieces too). A chat's
    rendered prompt holds its messages, tools and template: bounded by the body's size (every
    string in it, at least as long as JSON as in UTF-8) plus a few tokens per message for the
    template's markers. (The characters/4 estimate is far below the truth for CJK text, 1-3
    tokens a character, so it cannot decide to skip the count.)"""
    body = view.body
    cap = view.size
    if view.endpoint in (CHAT, RESPONSES):  # a Responses turn: the chat made of its history
        messages = body.get("messages") or () if view.endpoint == CHAT else messages_of(body)
        if cap:
            return cap + 8 * len(messages)
        total = 0
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):
                total += sum(_bytes(p.get("text"), 0) for p in content if isinstance(p, dict))
            else:
                total += _bytes(content, 0)
            total += 8
        return total + len(orjson.dumps(body["tools"])) if body.get("tools") else total
    prompt = body.get("text") if view.endpoint == GENERATE else body.get("prompt")
    if isinstance(prompt, list):
        return max((_bytes(p, cap) for p in prompt), default=0)
    return _bytes(prompt, cap) if prompt is not None else view.prompt_tokens


def _kept(text: object) -> int:
    """Characters of `text` a chat template keeps at least (some trim the ends)."""
    if not isinstance(text, str):
        return 0
    if text[:1].isspace() or text[-1:].isspace():
        return len(text.strip())
    return len(text)


def fewest_tokens(view: RequestView, token_bytes: int) -> int:
    """A lower bound of the longest prompt's tokens, when no token of the model's tokenizer
    stands for more than `token_bytes` bytes (`PromptTokens.token_bytes`): its text has at
    least as many bytes as characters. A chat counts the text of its messages but the
    assistant's (templates may drop earlier answers' reasoning), each as a template keeps it."""
    body = view.body
    if view.endpoint == CHAT:
        chars = 0
        for message in body.get("messages") or ():
            if not isinstance(message, dict) or message.get("role") == "assistant":
                continue
            content = message.get("content")
            if isinstance(content, list):
                chars += sum(_kept(p.get("text")) for p in content if isinstance(p, dict))
            else:
                chars += _kept(content)
        return chars // token_bytes
    prompt = body.get("text") if view.endpoint == GENERATE else body.get("prompt")
    if isinstance(prompt, list):
        return max((len(p) for p in prompt if isinstance(p, str)), default=0) // token_bytes
    return len(prompt) // token_bytes if isinstance(prompt, str) else 0


class ContextCheck:
    def __init__(self, models, client: httpx.AsyncClient | None, tokens=None) -> None:
        self.models = models  # gateway/scheduling/models.py: the request's model and its servers
        self.client = client
        self.tokens = tokens  # prompt_tokens.PromptTokens: the served model's tokenizer, if any
        self.in_turn = InTurn()  # the servers asked to count a prompt, in turn

    def limits(self, view: RequestView) -> Limits | None:
        """The least context length of the model's usable prefill servers (None: unknown),
        and the least prompt bound of its usable servers, either role (each validates)."""
        servers = self.models.of(view).servers
        contexts = [s.context_length for s in servers["prefill"]
                    if s.context_length and s.usable]
        if not contexts:
            return None
        context = min(contexts)
        bounds = [s.max_input_length for role in ("prefill", "decode")
                  for s in servers[role] if s.max_input_length and s.usable]
        return Limits(context, min([context, *bounds]))

    def check(self, view: RequestView) -> Coroutine[Any, Any, RequestView] | None:
        """Raise BadRequest if `view` cannot fit; None when that is settled here, else the
        coroutine to await that counts the prompt exactly first (a prompt near the limit) and
        returns the view (counted, when the tokenizer here counted it): the usual request
        makes no coroutine."""
        limits = self.limits(view)
        if limits is None or view.endpoint == MESSAGES:  # the server checks those: SGLang's
            return None  # 400 comes back in Anthropic's envelope (docs/RELIABILITY.md)
        new = requested_new_tokens(view)
        if view.lengths is not None:
            _fits(view.lengths, limits, new)
            return None
        self._by_size(view, limits, new)
        most = most_tokens(view)
        if most < NEAR * limits.prompt and most + (new or 0) < NEAR * limits.context:
            return None
        return self._check_counted(view, limits, new)

    def refuse_by_size(self, view: RequestView) -> None:
        """Raise BadRequest when the prompt's size alone proves it over the context (asked
        before anything is tokenized); nothing else is decided here."""
        if view.lengths is None and self.tokens is not None and self.tokens.token_bytes:
            limits = self.limits(view)
            if limits is not None:
                self._by_size(view, limits, requested_new_tokens(view))

    def _by_size(self, view: RequestView, limits: Limits, new: int | None) -> None:
        tokens = self.tokens
        if tokens is None or not tokens.token_bytes or not tokens.serves(view):
            return
        least = fewest_tokens(view, tokens.token_bytes)
        if least >= limits.prompt or (new is not None and least + new > limits.context):
            raise BadRequest(f"the prompt has at least {least} tokens (by its size), and "
                             f"{_bound(limits)}"
                             + (f" ({new} new tokens asked for)" if new else "")
                             + ": it does not fit", code="context_length_exceeded")

    async def _check_counted(self, view: RequestView, limits: Limits,
                             new: int | None) -> RequestView:
        """`view` counted (with exact lengths when the tokenizer here counted it), checked;
        CountUnavailable when nothing could count it."""
        lengths = None
        if self.tokens is not None:
            view = await self.tokens.count(view, needed=True)
            lengths = view.lengths
        if lengths is None:
            lengths = await self._count(view)
        if lengths is None:
            raise CountUnavailable(
                "the prompt is near or over the model's context length and its tokens could "
                "not be counted in time (no tokenizer for it here, and no server's "
                "/v1/tokenize answered); retry shortly", code="context_check_unavailable",
                headers={"Retry-After": RETRY_AFTER})
        _fits(lengths, limits, new)
        return view

    async def _count(self, view: RequestView) -> list[int] | None:
        """Exact prompt lengths from a server's own tokenizer, or None if none can say in
        time: the servers are asked in turn, within one deadline for them all, with one
        encoding of the prompt (it may be as large as the body)."""
        body = self._tokenize_body(view)
        if body is None or self.client is None:
            return None
        content = orjson.dumps(body)
        servers = self.in_turn.servers(self.models.of(view))
        try:
            return await self.in_turn.ask(servers, lambda server: self._ask(server, content),
                                          TOKENIZE_TIMEOUT, len(content))
        except NoAnswer:
            return None

    async def _ask(self, server: Server, content: bytes) -> list[int]:
        """The `count` of one server's /v1/tokenize answer, else NoAnswer. The answer also
        lists every token id (SGLang's `tokens` comes first: tens of MB for a huge prompt,
        hundreds as Python ints), so it is scanned as it streams in, never held or parsed
        whole."""
        headers = {"content-length": str(len(content)), "content-type": "application/json"}
        body = _slices(content) if len(content) > SLICE else content
        try:
            async with self.client.stream("POST", server.url + "/v1/tokenize", content=body,
                                          headers=headers) as response:
                if response.status_code != 200:
                    raise NoAnswer(f"{server.url} answered {response.status_code}")
                window = b""
                async for chunk in response.aiter_bytes():
                    window = window[-SCAN_WINDOW:] + chunk
                    found = _COUNT.search(window)
                    if found is not None:
                        count = orjson.loads(found.group(1))
                        return [count] if isinstance(count, int) else count
        except (httpx.HTTPError, orjson.JSONDecodeError) as exc:
            raise NoAnswer(f"{server.url}: {type(exc).__name__}") from None
        raise NoAnswer(f"{server.url}: no count in its answer")

    @staticmethod
    def _tokenize_body(view: RequestView) -> dict[str, Any] | None:
        body = view.body
        if view.endpoint == RESPONSES:  # the chat SGLang makes of the input (its history)
            return {"messages": messages_of(body)}
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


async def _slices(content: bytes) -> AsyncIterator[bytes]:
    for start in range(0, len(content), SLICE):
        yield content[start:start + SLICE]


def _bound(limits: Limits) -> str:
    if limits.prompt < limits.context:
        return (f"the servers take prompts of fewer than {limits.prompt} tokens (their "
                f"max_req_input_len; the model's context length is {limits.context})")
    return f"the model's context length is {limits.context} tokens"


def _fits(lengths, limits: Limits, new: int | None) -> None:
    """Raise BadRequest naming the numbers when a prompt (plus the new tokens) cannot fit."""
    context = limits.context
    for prompt in lengths:
        if prompt >= limits.prompt:
            raise BadRequest(f"the prompt has {prompt} tokens, and {_bound(limits)}: it "
                             "does not fit", code="context_length_exceeded")
        if new is not None and prompt + new > context:
            raise BadRequest(f"the prompt has {prompt} tokens and {new} new tokens were "
                             f"asked for: {prompt + new} tokens do not fit the model's "
                             f"context length of {context} tokens",
                             code="context_length_exceeded")
