"""The request view: parse and validate a body ONCE, derive everything routing needs.

Batch detection follows SGLang's `GenerateReqInput`: a `text` list, a 2-D `input_ids`, a
completions `prompt` list of strings or of token lists, and `n > 1` (parallel sampling) each
make SGLang expand the request into items, and every item needs its own bootstrap room.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

import orjson
import pydantic

from gateway import reach
from gateway.dispatch.inflight import client_rids
from gateway.errors import BadRequest

GENERATE = "generate"
CHAT = "chat"
COMPLETIONS = "completions"
RESPONSES = "responses"  # parsed by gateway/responses/view.py, served by its own endpoint
MESSAGES = "messages"  # Anthropic's Messages API: gateway/anthropic/

ENDPOINT_PATHS = {GENERATE: "/generate", CHAT: "/v1/chat/completions", COMPLETIONS: "/v1/completions"}
# every endpoint's upstream path (those above get the plain inference endpoint in app.py)
UPSTREAM_PATHS = {**ENDPOINT_PATHS, RESPONSES: "/v1/responses", MESSAGES: "/v1/messages"}
# Fields the gateway owns (docs/SECURITY.md, "Client-supplied routing fields"): PD pairing
# and DP-rank placement. A client value could collide with the gateway's rooms, or pin a rank
# that contradicts the room (SGLang fails such a request: CommonKVSender's
# "follow_bootstrap_room conflict"), so they are refused, naming the field.
PD_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key")
DP_FIELDS = ("routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank")
_OWNED = frozenset(PD_FIELDS + DP_FIELDS)
_CHECKED = _OWNED | reach.GUARDED  # fields a body seldom holds, each checked when it does


@dataclass(slots=True, eq=False)
class RequestView:
    """What the gateway needs to know about one inference request. Treated as immutable
    once anyone else holds it (derive with `dataclasses.replace`); the endpoint only fills in
    `priority` and `session` on the view it has just parsed. Not frozen: a frozen
    dataclass's __init__ costs 7x a plain one (3 us here, on every request)."""

    endpoint: str
    body: dict
    stream: bool
    batch_size: int | None  # None: a single prompt; else the number of prompts
    n: int  # parallel samples per prompt
    routing_text: str | None  # the full rendered prompt of the first item
    routing_tokens: tuple[int, ...] | None
    prompt_tokens: int  # prompt tokens over all prompts (exact if `lengths`, else estimated)
    model: str | None
    logprob_merge: bool  # prefill holds prompt logprobs that the answer must carry
    rids: tuple[str, ...] | None = None  # the client's own rid(s), validated
    # exact prompt tokens per prompt (token-id prompts, or counted by the tokenizer:
    # gateway/tokens/prompt_tokens.py); None: `prompt_tokens` is an estimate
    lengths: tuple[int, ...] | None = None
    # set by the endpoint from the tenancy headers (gateway/admission/tenancy.py) right after parsing:
    priority: int = 1  # class index: 0 interactive, 1 standard, 2 batch (config_tenants.py)
    session: bytes | None = None  # the session header's id, for session affinity
    slo: Any = None  # the SLO ticket (gateway/slo/ticket.py), set by the endpoint's gate
    # what the body makes the servers do that the operator must allow (gateway/reach.py)
    needs: frozenset[str] = reach.NOTHING
    size: int = 0  # bytes of the body as the client sent it (0: not from a client's bytes)
    # (body, the client's bytes of it): the legs forward those bytes as they are while the
    # view's body is that one (a derived view with another body encodes its own)
    source: tuple[dict, bytes | bytearray] | None = None
    # the body but the fields each leg sets, as JSON members, made once for every leg,
    # attempt and sample (gateway/dispatch/leg_bodies.py); a derived view starts without
    encoded: memoryview | None = dataclasses.field(default=None, init=False)

    @property
    def path(self) -> str:
        return UPSTREAM_PATHS[self.endpoint]

    @property
    def room_count(self) -> int | None:
        """Rooms to allocate: None for one scalar room, else one per expanded item."""
        if self.batch_size is None and self.n == 1:
            return None
        return (self.batch_size or 1) * self.n

    @property
    def routing_key(self) -> str | tuple[int, ...]:
        tokens = self.routing_tokens
        return tokens if tokens is not None else self.routing_text or ""


def json_object(raw: bytes | bytearray) -> dict:
    """The body as a JSON object, or BadRequest saying why it is not one."""
    if not raw:
        raise BadRequest("request body is empty; expected a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def parse_request(endpoint: str, raw: bytes | bytearray) -> RequestView:
    """Parse `raw` into a RequestView or raise BadRequest naming the field."""
    body = json_object(raw)
    needs = reach.NOTHING
    if not _CHECKED.isdisjoint(body):  # (one C-level test for the usual body without them)
        needs = _seldom_fields(body, endpoint)
    stream = _bool(body, "stream") if endpoint == GENERATE else _lax(body, "stream", bool, False)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string")
    if endpoint == GENERATE:
        view = _generate_view(body, stream, model)
    elif endpoint == CHAT:
        view = _chat_view(body, stream, model)
    else:
        view = _completions_view(body, stream, model)
    view.size, view.source = len(raw), (body, raw)  # (the view is new: nobody holds it yet)
    if needs:
        view.needs = view.needs | needs
    rids = client_rids(body.get("rid"), view.batch_size)
    return dataclasses.replace(view, rids=rids) if rids is not None else view


def _seldom_fields(body: dict, endpoint: str) -> frozenset[str]:
    """The gateway's own fields refused (docs/FIDELITY.md); what others need (gateway/reach.py)."""
    for name in PD_FIELDS:
        if body.get(name) is not None:
            raise BadRequest(f"'{name}' is assigned by the gateway; do not send it")
    for name in DP_FIELDS:
        if body.get(name) is not None:
            raise BadRequest(f"'{name}': data-parallel ranks are chosen by the gateway "
                             "(it steers each request to a rank through its bootstrap room)")
    return reach.fields(body, endpoint == GENERATE)


def _bool(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be a boolean")
    return bool(value)


_LAX = {bool: pydantic.TypeAdapter(bool), int: pydantic.TypeAdapter(int)}


def _lax(body: dict, name: str, kind: type, default: Any) -> Any:
    """An OpenAI body's bool or int field read by pydantic's lax mode, as SGLang's
    `CompletionRequest`/`ChatCompletionRequest` read `n`, `stream`, `echo`, `logprobs` ("true",
    1, "2", 2.0), so the gateway's stream, n split and logprob merge are SGLang's (else 400)."""
    value = body.get(name)
    if value is None or type(value) is kind:
        return default if value is None else value
    try:
        return _LAX[kind].validate_python(value)
    except pydantic.ValidationError:
        raise BadRequest(f"'{name}' must be {('an integer', 'a boolean')[kind is bool]}") from None


def _logprobs(body: dict, batch: int | None, n: int) -> bool:
    """`return_logprob`: a boolean, or for a batch of single samples one per prompt
    (GenerateReqInput._normalize_logprob_params); whether any prompt asks for logprobs."""
    value = body.get("return_logprob")
    if not isinstance(value, list):
        return _bool(body, "return_logprob")
    if batch is None or n > 1 or len(value) != batch \
            or not all(isinstance(v, bool) for v in value):
        raise BadRequest("'return_logprob' must be a boolean, or for a batch of single "
                         "samples a list of one boolean per prompt")
    return any(value)


def _n(value: Any, name: str) -> int:
    if value is not None and (type(value) is not int or value < 1):
        raise BadRequest(f"'{name}' must be a positive integer")
    return value or 1


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(type(t) is int for t in value)


def _generate_view(body: dict, stream: bool, model: str | None) -> RequestView:
    text, input_ids, embeds = body.get("text"), body.get("input_ids"), body.get("input_embeds")
    # GenerateReqInput._validate_inputs refuses all three (text and input_ids alone: here)
    if (text is None) == (input_ids is None) and (embeds is None or text is not None):
        raise BadRequest("one of 'text', 'input_ids' or 'input_embeds' is required (text and "
                         "input_ids not both)")
    if embeds is not None and (text is not None or input_ids is not None):
        _embeds(embeds, prompt=False)  # unused then, but parsed by SGLang all the same
    params = body.get("sampling_params")
    if params is not None and not isinstance(params, (dict, list)):
        raise BadRequest("'sampling_params' must be an object or a list of objects")
    if isinstance(params, list):
        if not params or not all(isinstance(p, dict) for p in params):
            raise BadRequest("'sampling_params' list must hold objects")
        n = _n(params[0].get("n"), "sampling_params.n")
        # GenerateReqInput._normalize_parallel_sampling: one n for every item (the gateway
        # forced n = 1 on each: a second item's n was silently taken from the first)
        if any(p.get("n", 1) != params[0].get("n", 1) for p in params):
            raise BadRequest("'sampling_params' items must all ask for the same 'n'")
    else:
        n = _n((params or {}).get("n"), "sampling_params.n")
    batch: int | None
    routing_text, routing_tokens, lengths = None, None, None
    if text is not None:
        if isinstance(text, str):
            batch, routing_text, chars = None, text, len(text)
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            batch, routing_text, chars = len(text), text[0], sum(len(t) for t in text)
        else:
            raise BadRequest("'text' must be a string or a non-empty list of strings")
        tokens = chars // 4 + 1
    elif input_ids is not None:
        if _is_token_list(input_ids) and input_ids:
            batch, routing_tokens, tokens = None, tuple(input_ids), len(input_ids)
            lengths = (tokens,)
        elif (isinstance(input_ids, list) and input_ids
              and all(_is_token_list(x) and x for x in input_ids)):
            batch, routing_tokens = len(input_ids), tuple(input_ids[0])
            lengths = tuple(len(x) for x in input_ids)
            tokens = sum(lengths)
        else:
            raise BadRequest("'input_ids' must be a non-empty list of ints or of int lists")
    else:
        batch, tokens = _embeds(embeds, prompt=True)
    if isinstance(params, list) and len(params) != (batch or 1):
        raise BadRequest("'sampling_params' list length must equal the batch size")
    if isinstance(params, list) and batch is None:
        body = _one_params(body, params, n)
    return RequestView(
        endpoint=GENERATE, body=body, stream=stream, batch_size=batch, n=n,
        routing_text=routing_text, routing_tokens=routing_tokens, prompt_tokens=tokens,
        model=model, logprob_merge=_logprobs(body, batch, n), lengths=lengths,
    )


def _one_params(body: dict, params: list, n: int) -> dict:
    """A single prompt's one-item `sampling_params` list, as SGLang's
    `GenerateReqInput._handle_parallel_sampling` takes it. n > 1 makes the prompt a batch of one
    and `_normalize_sampling_params` repeats the list n times: the request (and the answer, a list
    of n) of the object alone, which the n split needs, so the object goes on. With n == 1 the
    prompt stays single and `TokenizerManager._validate_one_request` fails on the list (a 500)."""
    if n == 1:
        raise BadRequest("'sampling_params' must be an object for a single prompt with n = 1")
    return {**body, "sampling_params": params[0]}


_NUMBERS = frozenset((float, int, bool))


def _embeds(embeds: Any, prompt: bool) -> tuple[int | None, int]:
    """`input_embeds` as SGLang takes it: its batch size (None: one prompt) and its rows (a
    token each), or BadRequest. Mirrors `GenerateReqInput.input_embeds`'s type,
    `List[List[List[float]]] | List[List[float]]` (managers/io_struct.py; FastAPI's pydantic
    parse, 400), and, when the embeddings are the prompt, `_determine_batch_size`'s read of
    `input_embeds[0][0]` (an IndexError, 500, on an empty list or first row)."""
    if _rows(embeds):
        batch, rows = None, len(embeds)
    elif isinstance(embeds, list) and all(map(_rows, embeds)):
        batch, rows = len(embeds), sum(map(len, embeds))
    else:
        raise BadRequest("'input_embeds' must be a list of rows of numbers (one prompt), or a "
                         "list of such lists (a batch)")
    if prompt and not (embeds and embeds[0]):
        raise BadRequest("'input_embeds' must hold a first prompt with a first row")
    return batch, rows


def _rows(value: Any) -> bool:
    """A `List[List[float]]` as pydantic's lax float takes it: numbers, booleans, and strings
    that read as a float once stripped, in ASCII (its own parser's, not Python's digits)."""
    if type(value) is not list or not all(type(row) is list for row in value):
        return False
    kinds = set(map(type, itertools.chain.from_iterable(value)))  # (C loops: rows can be long)
    if kinds <= _NUMBERS:
        return True
    return kinds <= _NUMBERS | {str} and all(
        _float_text(x) for row in value for x in row if type(x) is str)


def _float_text(text: str) -> bool:
    try:
        return text.strip().isascii() and float(text) is not None
    except ValueError:
        return False


def render_messages(messages: list[dict]) -> str:
    """A stable text rendering of ALL chat messages: the routing key for prefix caching."""
    parts: list[str] = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content)
        parts.append(f"<|{message.get('role', '')}|>{content or ''}")
    return "\n".join(parts)


def _chat_view(body: dict, stream: bool, model: str | None) -> RequestView:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list")
    fetches = False  # a part names media by URL (gateway/reach.py)
    extra = 0  # characters the template renders besides the messages' text (estimate only)
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"'messages[{i}]' must be an object with a string 'role'")
        content = message.get("content")
        if len(message) > 2 or content is None:  # not just role and content: a name, tool
            extra += _message_extra(message)  # calls, reasoning (the cheap test first)
        if content is not None and not isinstance(content, (str, list)):
            raise BadRequest(f"'messages[{i}].content' must be a string or a list of parts")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict) or not isinstance(part.get("text", ""), str):
                    raise BadRequest(f"'messages[{i}].content[{j}]' must be an object whose "
                                     "'text', if any, is a string")
                fetches |= reach.part(part, f"messages[{i}].content[{j}]")
    ids, text, lengths = body.get("input_ids"), None, None
    if ids and _is_token_list(ids):  # serving_chat's `if request.input_ids is not None`: the
        tokens, lengths = len(ids), (len(ids),)  # prompt as is, no template (like /generate's)
    else:
        text = render_messages(messages)
        tokens = (len(text) + extra + tools_chars(body)) // 4 + 1
    return RequestView(
        endpoint=CHAT, body=body, stream=stream, batch_size=None,
        n=_n(_lax(body, "n", int, 1), "n"), routing_text=text,
        routing_tokens=tuple(ids) if lengths else None, prompt_tokens=tokens,
        model=model, logprob_merge=False, lengths=lengths,
        needs=frozenset((reach.MEDIA_URLS,)) if fetches else reach.NOTHING,
    )


def tools_chars(body: dict) -> int:
    """Characters of the body's tool definitions, for the estimate: the template renders each
    one (name, description, parameters), so a prompt of huge definitions is a huge prompt
    (chat, Messages and Responses alike; unserializable values are the parser's to refuse)."""
    tools = body.get("tools")
    if not tools:
        return 0
    try:
        return len(orjson.dumps(tools))
    except (orjson.JSONEncodeError, TypeError):
        return 0


def _message_extra(message: dict) -> int:
    """Characters of a message the template renders besides its content, for the estimate:
    its `name`, `reasoning_content`, and each tool call's name and arguments (a flood of
    tool calls passed a token limit that the same text as content met)."""
    extra = 0
    for field in ("name", "reasoning_content"):
        value = message.get(field)
        if isinstance(value, str):
            extra += len(value)
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict):
                continue
            for value in (function.get("name"), function.get("arguments")):
                if isinstance(value, str):
                    extra += len(value)
                elif value is not None:  # arguments as an object: rendered as JSON
                    extra += len(orjson.dumps(value))
    return extra


def _completions_view(body: dict, stream: bool, model: str | None) -> RequestView:
    prompt = body.get("prompt")
    routing_text, routing_tokens, lengths = None, None, None
    if isinstance(prompt, str):
        batch, routing_text, tokens = None, prompt, len(prompt) // 4 + 1
    elif _is_token_list(prompt) and prompt:
        batch, routing_tokens, tokens = None, tuple(prompt), len(prompt)
        lengths = (tokens,)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        batch, routing_text = len(prompt), prompt[0]
        tokens = sum(len(p) for p in prompt) // 4 + 1
    elif isinstance(prompt, list) and prompt and all(_is_token_list(p) and p for p in prompt):
        batch, routing_tokens = len(prompt), tuple(prompt[0])
        lengths = tuple(len(p) for p in prompt)
        tokens = sum(lengths)
    else:
        raise BadRequest("'prompt' must be a string, a list of strings, a list of token ids "
                         "or a list of token-id lists")
    logprobs = _lax(body, "logprobs", int, None)
    echo = _lax(body, "echo", bool, False)
    return RequestView(
        endpoint=COMPLETIONS, body=body, stream=stream, batch_size=batch,
        n=_n(_lax(body, "n", int, 1), "n"), routing_text=routing_text,
        routing_tokens=routing_tokens, prompt_tokens=tokens, model=model,
        logprob_merge=echo and logprobs is not None, lengths=lengths,
    )
