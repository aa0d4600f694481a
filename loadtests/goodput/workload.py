"""The mixed workload of the goodput benchmark, drawn once per (rate, seed) for every router.

Three kinds of requests arrive open-loop (nothing waits for an answer before sending):

* chat: conversations start as a Poisson process; each picks one of a few long system prompts
  (one hot: `system_weights`), then sends its turns at planned think-time gaps. Each turn is
  the whole history so far: the system prompt, the earlier user messages and replies (the
  replies are drawn in advance, so the plan does not depend on any router's answers; the
  prefill cache only sees the prompt), then a new user message.
* docqa: questions about a few long documents (Zipf popularity), the document being the system
  message, arriving as a Poisson process.
* short: short prompts asking for long outputs (decode-heavy), a Poisson process.

The shares of the three are of requests, so the whole is about `rate` requests per second.
Each request carries its objectives: TTFT (a longer budget above `long_prompt` prompt tokens)
and mean inter-token latency, sent as `x-slo-ttft-ms` and `x-slo-itl-ms`. Prompt sizes are the
simulator's token counts (4 UTF-8 bytes per token, `backends/sim/tokenizer.py`) of the
simulator's chat template, so the DES of `capacity.py` sees the same ids as the servers.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from backends.sim.tokenizer import encode, render_chat
from loadtests.routing.workloads import (
    CHAT_PATH,
    chat_body,
    poisson_times,
    words,
    zipf_weights,
)

KINDS = ("chat", "docqa", "short")


@dataclass(frozen=True)
class Objectives:
    ttft_ms: float = 1500.0
    long_ttft_ms: float = 3000.0  # above `long_prompt` prompt tokens
    long_prompt: int = 4096
    itl_ms: float = 60.0

    def ttft_for(self, prompt_tokens: int) -> float:
        return self.long_ttft_ms if prompt_tokens > self.long_prompt else self.ttft_ms


@dataclass(frozen=True)
class MixShape:
    shares: tuple[float, float, float] = (0.5, 0.3, 0.2)  # chat, docqa, short
    system_prompts: int = 4
    system_tokens: int = 2000
    system_weights: tuple[float, ...] = (0.7, 0.1, 0.1, 0.1)  # the first one is hot
    turns: tuple[int, int] = (2, 5)  # per conversation, uniform
    user_tokens: tuple[int, int] = (50, 300)
    reply_tokens: tuple[int, int] = (32, 128)  # chat max_tokens (the sim generates them all)
    think_s: float = 3.0  # mean gap between a conversation's turns (exponential)
    documents: int = 4
    document_tokens: int = 6000
    question_tokens: tuple[int, int] = (10, 60)
    answer_tokens: tuple[int, int] = (16, 96)
    short_tokens: tuple[int, int] = (30, 150)
    long_output: tuple[int, int] = (200, 500)

    @property
    def mean_turns(self) -> float:
        return (self.turns[0] + self.turns[1]) / 2


# The dominant hot prompt (issue 24): half the requests open with one ~4 KB system prompt (1,000
# tokens), the other half ask about one of 8 documents of 3,000 tokens (Zipf). With 16K tokens
# of prefix cache per prefill (`HOT_CACHE_TOKENS`; the KV pools keep their full size) a server
# holds about half the documents: the
# documents gain from being partitioned, the hot prompt's turns (cheap once cached) from being
# spread over every prefill.
HOT_SHAPE = MixShape(shares=(0.5, 0.5, 0.0), system_prompts=1, system_tokens=1000,
                     system_weights=(1.0,), turns=(1, 3), documents=8, document_tokens=3000)
HOT_CACHE_TOKENS = 16384

QUICK_SHAPE = MixShape(system_prompts=2, system_tokens=300, system_weights=(0.8, 0.2),
                       turns=(2, 3), user_tokens=(20, 60), reply_tokens=(4, 12), think_s=0.5,
                       documents=2, document_tokens=1200, question_tokens=(5, 20),
                       answer_tokens=(4, 12), short_tokens=(10, 40), long_output=(24, 48))


@dataclass(frozen=True)
class Planned:
    """One request of the plan: when it is sent and what it asks."""

    at: float  # offset from the run's start, seconds
    kind: str  # one of KINDS
    messages: tuple[dict, ...]
    max_tokens: int
    prompt_tokens: int  # the simulator's count of the rendered prompt
    ttft_ms: float
    itl_ms: float

    def body(self) -> dict:
        return chat_body(list(self.messages), self.max_tokens)

    def headers(self) -> dict[str, str]:
        return {"x-slo-ttft-ms": f"{self.ttft_ms:g}", "x-slo-itl-ms": f"{self.itl_ms:g}"}

    def prompt_ids(self) -> list[int]:
        """The token ids the servers see (the sim's chat template, then its tokenizer)."""
        return encode(render_chat(list(self.messages)))


@dataclass(frozen=True)
class Plan:
    shape: MixShape
    rate: float
    duration: float
    requests: tuple[Planned, ...]  # by `at`

    path: str = CHAT_PATH

    def counts(self) -> dict[str, int]:
        return {k: sum(r.kind == k for r in self.requests) for k in KINDS}


def _planned(at: float, kind: str, messages: list[dict], max_tokens: int,
             objectives: Objectives) -> Planned:
    tokens = len(encode(render_chat(messages)))
    return Planned(at, kind, tuple(messages), max_tokens, tokens,
                   objectives.ttft_for(tokens), objectives.itl_ms)


def _chat(rng: random.Random, shape: MixShape, rate: float, duration: float,
          objectives: Objectives) -> list[Planned]:
    systems = [f"Assistant {i}. " + words(rng, shape.system_tokens)
               for i in range(shape.system_prompts)]
    out: list[Planned] = []
    for start in poisson_times(rng, rate / shape.mean_turns, duration):
        index = rng.choices(range(shape.system_prompts), shape.system_weights)[0]
        messages = [{"role": "system", "content": systems[index]}]
        at = start
        for _ in range(rng.randint(*shape.turns)):
            if at >= duration:
                break
            messages.append({"role": "user", "content": words(rng, rng.randint(
                *shape.user_tokens))})
            reply = rng.randint(*shape.reply_tokens)
            out.append(_planned(at, "chat", messages, reply, objectives))
            messages = messages + [{"role": "assistant", "content": words(rng, reply)}]
            at += rng.expovariate(1.0 / shape.think_s)
    return out


def _docqa(rng: random.Random, shape: MixShape, rate: float, duration: float,
           objectives: Objectives) -> list[Planned]:
    documents = [f"Document {i}.\n" + words(rng, shape.document_tokens)
                 for i in range(shape.documents)]
    weights = zipf_weights(shape.documents, 1.0)
    out = []
    for at in poisson_times(rng, rate, duration):
        doc = documents[rng.choices(range(shape.documents), weights)[0]]
        question = words(rng, rng.randint(*shape.question_tokens)) + "?"
        messages = [{"role": "system", "content": doc}, {"role": "user", "content": question}]
        out.append(_planned(at, "docqa", messages, rng.randint(*shape.answer_tokens),
                            objectives))
    return out


def _short(rng: random.Random, shape: MixShape, rate: float, duration: float,
           objectives: Objectives) -> list[Planned]:
    out = []
    for at in poisson_times(rng, rate, duration):
        messages = [{"role": "user", "content": "Write at length: " + words(
            rng, rng.randint(*shape.short_tokens))}]
        out.append(_planned(at, "short", messages, rng.randint(*shape.long_output), objectives))
    return out


def mixed_plan(shape: MixShape, rate: float, duration: float, seed: int,
               objectives: Objectives = Objectives()) -> Plan:
    """About `rate` requests per second for `duration` seconds; each kind has its own seeded
    generator, so a kind's requests do not change when another kind's share does."""
    if abs(sum(shape.shares) - 1.0) > 1e-9:
        raise ValueError(f"shares must sum to 1, got {shape.shares}")
    if len(shape.system_weights) != shape.system_prompts:
        raise ValueError("one weight per system prompt")
    makers = (_chat, _docqa, _short)
    requests: list[Planned] = []
    for kind, share, make in zip(KINDS, shape.shares, makers, strict=True):
        if share > 0:
            rng = random.Random(f"goodput/{kind}/{seed}")
            requests += make(rng, shape, rate * share, duration, objectives)
    requests.sort(key=lambda r: r.at)
    return Plan(shape, rate, duration, tuple(requests))


WARMUP_SHARE = 0.25  # of the measured rate: below any router's knee, so no queue is left


def warmup_plan(shape: MixShape, rate: float, seconds: float, seed: int) -> Plan | None:
    """What a run is preceded by so that it measures servers in their steady state: the
    same documents and system prompts (drawn first from the same seed), at `WARMUP_SHARE`
    of `rate`, for `seconds`; None for none. Every run starts on flushed caches, and a cold
    start at the measured rate computes each document and hot prompt once per request in
    flight before the first is cached (the 32B calibration at 33 requests/s: 67k new
    tokens in the first 2 s of one plan, a prefix hit ratio of 0.43, 2 s of queue), so a
    12 s run's attainment hung on its first seconds (docs/BENCHMARKS.md)."""
    if seconds <= 0:
        return None
    return mixed_plan(shape, rate * WARMUP_SHARE, seconds, seed)
