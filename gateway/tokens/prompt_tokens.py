"""Exact prompt tokens for every request shape, when the served model's tokenizer is here.

With a tokenizer (`--tokenizer PATH`, or the path the servers report in `/model_info` when it
is readable here), a text or chat request is tokenized once, as SGLang 0.5.23 tokenizes it
(gateway/tokens/tokenizer.py), when something needs its exact tokens: a prefill policy that matches
token ids (`prefix_cache`), a per-key prompt-token limit (`--rate-limit-tokens`), or the
context check for a prompt near the model's limit. Tokenizing costs about a microsecond per
token (30-60 us for a short prompt, as much as the rest of the request; docs/BENCHMARKS.md),
so the default policies do without it. The counted view carries:
* `routing_tokens`: the first prompt's ids, so `prefix_cache` matches chat and text prompts
  block by block against the servers' KV events, and `cache_aware` keys its tree by tokens;
* `prompt_tokens` and `lengths`: exact counts for the load policies, the cost model
  (`min_ttft`), the context check and the per-key prompt-token limit.
Token-id prompts are counted as they are. Without a tokenizer, or for a request the tokenizer
does not mirror (`TokenizerError`), nothing changes: the view keeps the characters/4 estimate
and the request is forwarded as sent.

The request sent upstream stays the client's (text or messages). Sending `input_ids` instead
would spare the server its tokenization, but that is a small share of its work next to the
prefill, would change what SGLang echoes back (prompt text in logprobs, `echo`), and would
make any difference between our tokenizer and the server's a different answer rather than a
slightly different route.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Callable

import httpx

from gateway.request import CHAT, COMPLETIONS, GENERATE, RESPONSES, RequestView
from gateway.responses.view import messages_of
from gateway.tokens.tokenizer import (
    GatewayTokenizer,
    TokenizerError,
    TokenizerLoadError,
    load_tokenizer,
    tokenizer_path_from_model_info,
)

log = logging.getLogger("gateway.tokens")

MODEL_INFO_TIMEOUT = 5.0


class PromptTokens:
    def __init__(self, threads: int = 2, always: bool = False) -> None:
        self.threads = threads
        self.always = always  # tokenize every request (a policy or limit needs exact tokens)
        self.tokenizer: GatewayTokenizer | None = None
        # no token of the tokenizer stands for more bytes of text than this (None: no sound
        # bound, or no tokenizer): the context check's proof by size (context_check.py)
        self.token_bytes: int | None = None
        self.counted = 0  # requests given exact counts by the tokenizer
        self.skipped = 0  # requests it does not mirror (kept the estimate)
        # which requests the tokenizer is for: those of its model (gateway/scheduling/models.py)
        self.serves: Callable[[RequestView], bool] = lambda view: True

    async def load(self, path: str | None, client: httpx.AsyncClient | None,
                   servers: list[str],
                   serves: Callable[[RequestView], bool] | None = None) -> None:
        """Load `path`, else the tokenizer the first answering server reports; a broken
        explicit path is an error, a reported path that is not readable here is not.
        `serves`: which requests it is for (those of its model; default: all)."""
        if serves is not None:
            self.serves = serves
        explicit = path is not None
        if path is None and client is not None:
            path = await _reported_path(client, servers)
        if path is None:
            log.info("no tokenizer: prompt tokens are estimated (set --tokenizer for exact "
                     "counts and exact prefix routing of chat and text prompts)")
            return
        try:
            self.tokenizer = await asyncio.to_thread(load_tokenizer, path, threads=self.threads)
        except TokenizerLoadError as exc:
            if explicit:
                raise
            log.warning("the servers' tokenizer %s cannot be used here: %s", path, exc)
            return
        if self.tokenizer is not None:
            self.token_bytes = longest_token_bytes(self.tokenizer.backend)
            log.info("%s", self.tokenizer.describe())

    def wanted(self, view: RequestView, needed: bool | None = None) -> bool:
        """Would `count` tokenize `view`? (Asked first on every request, so most requests
        make no coroutine for it.)"""
        return self.tokenizer is not None and view.lengths is None and (
            self.always if needed is None else needed) and self.serves(view)

    async def count(self, view: RequestView, needed: bool | None = None) -> RequestView:
        """`view` with exact token counts (and ids as the routing key) where possible, if
        `needed` (default: `always`, set when a policy or limit needs every prompt's)."""
        if not self.wanted(view, needed):
            return view
        tokenizer = self.tokenizer
        try:
            if view.endpoint == CHAT:
                prompts = [await tokenizer.aencode_chat(view.body)]
            elif view.endpoint == RESPONSES:  # the chat SGLang makes of the input
                prompts = [await tokenizer.aencode_chat({"messages": messages_of(view.body)})]
            elif view.endpoint == GENERATE:
                prompts = await tokenizer.aencode_generate(view.body)
            elif view.endpoint == COMPLETIONS:
                prompts = await tokenizer.aencode_prompt(view.body.get("prompt"))
            else:
                return view
        except TokenizerError:
            self.skipped += 1
            return view
        if not prompts or not prompts[0]:
            return view
        self.counted += 1
        lengths = tuple(len(p) for p in prompts)
        return dataclasses.replace(view, routing_tokens=tuple(prompts[0]),
                                   prompt_tokens=sum(lengths), lengths=lengths)

    def close(self) -> None:
        if self.tokenizer is not None:
            self.tokenizer.close()

    def stats(self) -> dict:
        return {"tokenizer": self.tokenizer.describe() if self.tokenizer else None,
                "counted": self.counted, "skipped": self.skipped}


# How many times shorter (in UTF-8 bytes) a normalizer can make a text: NFC composes (a Hangul
# syllable from 3 jamo, 9 bytes to 3; the Kelvin sign, 3 bytes, to "K"), NFD and lowercasing
# map such singletons too, the compatibility forms fold 4-byte letters to ASCII ("𝐀" to "A").
# Normalizers not listed (accent and space stripping, SentencePiece's precompiled map) can
# shrink a text without bound: no proof by size for those.
_SHRINK = {"NFC": 3, "NFD": 3, "NFKC": 4, "NFKD": 4, "Lowercase": 3, "Prepend": 1,
           "ByteLevel": 1}


def _shrink(normalizer: dict | None) -> int | None:
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for step in normalizer.get("normalizers") or ():
            one = _shrink(step)
            if one is None:
                return None
            factor *= one
        return factor
    if kind == "Replace":  # a pattern -> content: shrinks by their ratio at most
        pattern = (normalizer.get("pattern") or {}).get("String")
        content = normalizer.get("content") or ""
        if not isinstance(pattern, str) or not content:
            return None
        return max(1, -(-len(pattern.encode()) // len(content.encode())))
    return _SHRINK.get(kind)


def longest_token_bytes(backend) -> int | None:
    """At most how many bytes of the input text one token stands for: the longest token's
    UTF-8 spelling (which never shows fewer bytes than it stands for: byte-level symbols,
    SentencePiece's "▁" and "<0x..>" pieces all spell one byte with one or more), times what
    the normalizer can shrink a text by; None when the normalizer can shrink without bound."""
    normalizer = json.loads(backend.to_str()).get("normalizer")
    factor = _shrink(normalizer)
    if factor is None:
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    return factor * max((len(token.encode("utf-8", "surrogatepass")) for token in vocab),
                        default=1)


async def _reported_path(client: httpx.AsyncClient, servers: list[str]) -> str | None:
    """The tokenizer path the first server that answers `/model_info` reports, if usable."""
    for url in servers:
        try:
            async with asyncio.timeout(MODEL_INFO_TIMEOUT):
                response = await client.get(url + "/model_info")
            info = response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, TimeoutError, ValueError):
            continue
        if isinstance(info, dict):
            return tokenizer_path_from_model_info(info)
    return None
