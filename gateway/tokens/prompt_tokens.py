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
import logging
from collections.abc import Callable

import httpx

from gateway.request import CHAT, COMPLETIONS, GENERATE, RequestView
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
