"""Completion tokens from the decode's answer as the client gets it, read cheaply.

Where SGLang 0.5.23 reports them (paths under sglang/srt/):

* native `/generate`: every answer and every streamed event carries `meta_info` with
  `prompt_tokens`, `completion_tokens` (cumulative in a stream) and `cached_tokens`
  (`managers/tokenizer_manager.py`, the meta_info of each output); a batch's stream tags
  each event with its `index`, and an item's last event has a non-null `finish_reason`.
* OpenAI routes: a whole answer has `usage` (`entrypoints/openai/usage_processor.py`); a
  stream has usage only in one last event with empty `choices`, right before `[DONE]`, when
  the request asks for it (`stream_options.include_usage`, `should_include_usage` in
  `entrypoints/openai/utils.py`), or in every chunk with `continuous_usage_stats`.

So the gateway never parses the JSON of every streamed chunk: a whole answer is scanned for
the key `"completion_tokens"` (a byte search, no parse), a single stream's last two chunks
are scanned at its end, and only two kinds of stream pay a substring test per chunk:

* an OpenAI stream whose client did not ask for usage (no `stream_options`, or without
  `include_usage`): the gateway asks both legs for the usage event (`leg_stream_options`:
  the prefill's gives the prompt and cached tokens, the decode's the completion tokens) and
  takes it out of what the client receives (`StreamTokens.feed`), so the client sees exactly
  the stream it asked for. (Until 2026-12-07 a client that sent `stream_options` without
  `include_usage` was not asked for it: its tokens went uncounted, by tenant and key alike);
* a native stream of several items (a batch, or n > 1): each chunk holding a final event
  (`"finish_reason":{`) is scanned for that item's count.

A string value cannot hold the key: inside a JSON string every `"` is escaped, so the
bytes `"completion_tokens"` followed by `:` only occur as a key.

An OpenAI stream cut before its usage event (the client left, the decode failed, the gateway
stopped) counts a lower bound from what each decode stream relayed (`relayed_tokens`, read
once at the request's end, docs/TENANCY.md): SGLang sends an event per decode step (one
token or more, `stream_interval`), so the events that carry a choice's new text are at most
its tokens.
"""

from __future__ import annotations

import re

import orjson

from gateway.request import CHAT, COMPLETIONS, GENERATE, RequestView
from gateway.sse import DONE, data_objects

KEY = b'"completion_tokens"'
USAGE_MARKS = (b'"usage":{', b'"usage": {')
FINAL_MARKS = (b'"finish_reason":{', b'"finish_reason": {')
TAIL_LIMIT = 1 << 16  # bytes of a stream's end that are scanned for its final figures


_USAGE_EVENT = (CHAT, COMPLETIONS)  # streams with a usage event (Responses: response.completed)


_LAX_TRUE = {"1", "on", "t", "true", "y", "yes"}  # what pydantic's lax bool reads as true


def client_asks_usage(body: dict) -> bool:
    """`stream_options.include_usage`, read as SGLang's request model reads it."""
    options = body.get("stream_options")
    value = options.get("include_usage") if isinstance(options, dict) else None
    return value is True or (type(value) in (int, float) and value == 1) or (
        isinstance(value, str) and value.lower() in _LAX_TRUE)


def usage_forced(view: RequestView) -> bool:
    """An OpenAI stream whose client did not ask for usage: the gateway asks for the usage
    event and keeps it from the client."""
    return view.stream and view.endpoint in _USAGE_EVENT and not client_asks_usage(view.body)


def leg_stream_options(view: RequestView) -> object:
    """The `stream_options` both legs get (None: none). Forced, the client's own options
    plus `include_usage`, without `continuous_usage_stats` (usage in every chunk: more to
    take out than the one event; SGLang gives it only with `include_usage` anyway)."""
    options = view.body.get("stream_options")
    if not usage_forced(view):
        return options
    forced = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    forced.pop("continuous_usage_stats", None)
    return forced


# the key, JSON whitespace, a colon, whitespace, the integer (a C-level scan, no parse);
# an Anthropic answer (/v1/messages) calls it `output_tokens`
_COUNT = re.compile(rb'"(?:completion|output)_tokens"[ \t\r\n]*:[ \t\r\n]*([0-9]+)')
OUTPUT_KEY = b'"output_tokens"'


def completion_total(body: bytes) -> int | None:
    """The completion tokens of a whole answer: one `usage`, or one `meta_info` per item of a
    native batch (summed); None when the answer says nothing."""
    values = _COUNT.findall(body)
    return sum(map(int, values)) if values else None


def completion_final(data: bytes) -> int | None:
    """The last count in `data` (a stream's end: its usage event, or its last meta_info)."""
    start = max(0, len(data) - TAIL_LIMIT)
    at = max(data.rfind(KEY, start), data.rfind(OUTPUT_KEY, start))
    if at < 0:
        return None
    found = _COUNT.match(data, at)
    return int(found[1]) if found is not None else None


def prompt_usage(body: bytes) -> tuple[int, int]:
    """(prompt_tokens, cached_tokens) of a prefill's answer, summed over its items: a
    native answer's `meta_info` (one per item of a batch), an OpenAI answer's `usage` (its
    cached count under `prompt_tokens_details`); an SSE body (a streamed prefill answer)
    summed over its events. Parsed (orjson), not scanned: two keys, where a byte scan per
    key cost more than the parse."""
    first = body[:1]
    try:
        if first == b"{" or first == b"[" or body.lstrip()[:5] not in (b"data:", b"event"):
            items = orjson.loads(body)
        else:
            items = data_objects(body)
    except orjson.JSONDecodeError:
        return 0, 0
    if isinstance(items, dict):
        items = (items,)
    elif not isinstance(items, list):
        return 0, 0
    prompt = cached = 0
    for item in items:
        if not isinstance(item, dict):
            continue
        meta = item.get("meta_info")
        if isinstance(meta, dict):
            prompt += meta.get("prompt_tokens") or 0
            cached += meta.get("cached_tokens") or 0
            continue
        usage = item.get("usage")
        if usage is None and isinstance(item.get("message"), dict):  # Anthropic's message_start
            usage = item["message"].get("usage")
        if usage is None and isinstance(item.get("response"), dict):  # a Responses event
            usage = item["response"].get("usage")
        if isinstance(usage, dict) and "input_tokens" in usage:  # Anthropic: the uncached part
            cache = usage.get("cache_read_input_tokens") or 0
            prompt += (usage.get("input_tokens") or 0) + cache
            details = usage.get("input_tokens_details")  # Responses: all in input_tokens
            cached += cache + ((details.get("cached_tokens") or 0)
                               if isinstance(details, dict) else 0)
        elif isinstance(usage, dict):
            prompt += usage.get("prompt_tokens") or 0
            details = usage.get("prompt_tokens_details") or {}
            cached += details.get("cached_tokens") or 0
    return prompt, cached


class StreamTokens:
    """Per-chunk work of the two kinds of stream that need it (see the module docstring).

    `feed` returns the chunk to send (without the usage event the client did not ask for);
    `completion` is the count once the stream's final events went by, else None. A chunk
    holding neither of `marks` needs no `feed`: the relay tests them itself, so most chunks
    cost two substring tests and no call."""

    __slots__ = ("forced", "completion", "_finals", "marks")

    def __init__(self, forced: bool) -> None:
        self.forced = forced
        self.completion: int | None = None
        self._finals = 0
        self.marks = USAGE_MARKS if forced else FINAL_MARKS

    @classmethod
    def of(cls, view: RequestView) -> StreamTokens | None:
        """The meter a stream needs, or None: a single stream is read at its end only."""
        if usage_forced(view):
            return cls(True)
        if view.endpoint == GENERATE and (view.batch_size is not None or view.n > 1):
            return cls(False)
        return None

    def feed(self, chunk: bytes) -> bytes:
        if self.forced:
            if USAGE_MARKS[0] in chunk or USAGE_MARKS[1] in chunk:
                return self._take_usage(chunk)
            return chunk
        if FINAL_MARKS[0] in chunk or FINAL_MARKS[1] in chunk:
            for event in chunk.split(b"\n\n"):
                if FINAL_MARKS[0] in event or FINAL_MARKS[1] in event:
                    self._finals += completion_final(event) or 0
                    self.completion = self._finals
        return chunk

    def _take_usage(self, chunk: bytes) -> bytes:
        """The chunk without its usage event (empty `choices`), whose count is kept."""
        kept = []
        for event in chunk.split(b"\n\n"):
            if not event:
                continue
            if USAGE_MARKS[0] in event or USAGE_MARKS[1] in event:
                obj = _payload(event)
                usage = obj.get("usage") if isinstance(obj, dict) else None
                if isinstance(usage, dict) and not obj.get("choices"):
                    count = usage.get("completion_tokens")
                    self.completion = count if isinstance(count, int) else None
                    continue
            kept.append(event + b"\n\n")
        return b"".join(kept)


def _payload(event: bytes) -> object:
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            try:
                return orjson.loads(line[5:])
            except orjson.JSONDecodeError:
                return None
    return None


# -- a stream cut before its usage event ------------------------------------------------------

# events a choice's stream may send after its last token, none with text: its finish, hidden
# states, two `sglext` events, usage (SGLang's `_generate_chat_stream`)
TRAILING = 5
FINISHED = (b'"finish_reason":"', b'"finish_reason": "')  # a reason, not null


def relayed_tokens(endpoint: str, chunks: int, last: bytes, capture) -> int:
    """At least the completion tokens one decode stream relayed (one choice: the gateway
    splits n > 1), from what the relay has at hand at its end (relay.StreamRelay._end):

    * the count of its last events, when they hold one (a sample's usage event);
    * else its last chunk's events with text, plus one per earlier chunk (each holds a whole
      event or more), less the chunks that may hold none: a chat's role event (not when
      its chunk is kept and holds more), the events after the last token when the last
      chunk has neither text nor a finish. One event a chunk: exact;
    * but where the chunks were kept for a continuation (`capture`: a resumable stream, the
      default for plain chat and completions) and held more than one event each on average
      (the decode ran ahead of the relay: a slow client, which one per chunk would let pay
      for a fraction), or were 2 at most: their events with text, scanned."""
    if last == DONE:  # (nothing to read in it)
        found, ended = 0, False
    else:
        count = completion_final(last) if last else None
        if count is not None:
            return count
        found = text_events(last, endpoint)
        ended = found or FINISHED[0] in last or FINISHED[1] in last
    spare = (0 if ended else TRAILING) + (endpoint == CHAT and chunks > 1)  # (a role's)
    kept = capture.chunks if capture is not None and capture.usable else ()
    if len(kept) > 2:
        one = min(len(kept[1]), len(kept[-2]))  # one event (the client kept up then)
        if 2 * capture.size <= 3 * len(kept) * one:  # one event a chunk: no scan
            spare -= endpoint == CHAT and 2 * len(kept[0]) >= 3 * one  # role and text
            return found + max(0, chunks - 1 - spare)
    elif not kept:
        return found + max(0, chunks - 1 - spare)
    return max(found + max(0, chunks - 1 - spare), text_events(b"".join(kept), endpoint))


def text_events(events: bytes, endpoint: str) -> int:
    """The events of one choice that carry new text, each at least one token: keys counted,
    no parse (a JSON string escapes every `"`, so text that names a key never matches). A
    chat step can give two events (a reasoning parser's end of the reasoning and the
    answer's start; text, then a tool call): one less for each kind of text beyond the
    first."""
    keys = _SPACED if b'": "' in events else _COMPACT  # SGLang's pydantic, or json.dumps
    if endpoint == COMPLETIONS:
        return events.count(keys[0]) - events.count(keys[0] + b'"')
    reasoning = events.count(keys[1]) - events.count(keys[1] + b'"')
    content = events.count(keys[2]) - events.count(keys[2] + b'"') - reasoning
    tools = events.count(keys[3])
    kinds = (reasoning > 0) + (content > 0) + (tools > 0)
    return reasoning + content + tools - max(0, kinds - 1)


def _keys(colon: bytes) -> tuple[bytes, ...]:
    """A key of new text and the start of its value: a completion's text, a chat's reasoning,
    its content (the reasoning's key ends the same), a tool call (a list of objects)."""
    return (b'"text"' + colon + b'"', b'reasoning_content"' + colon + b'"',
            b'content"' + colon + b'"', b'"tool_calls"' + colon + b"[{")


_COMPACT, _SPACED = _keys(b":"), _keys(b": ")
