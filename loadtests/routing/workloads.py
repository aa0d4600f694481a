"""The two routing workloads, drawn once from a seed so that every target replays the same plan.

* chat: conversations arrive as a Poisson process. Each picks one of a few long system prompts
  (Zipf popularity: a product has one main assistant and a few niche ones), then runs its turns:
  the full history plus a new user message is sent to `/v1/chat/completions`, the streamed
  reply is appended, the user "thinks", and the next turn follows. The history grows every
  turn and only this conversation shares it, so only a router that keeps a conversation on
  the server holding its history gets more than the system prompt from the cache.
* fewshot: requests arrive as a Poisson process; each is one of a few long few-shot prefixes
  (Zipf popularity) followed by a short question, sent to `/generate` as `input_ids`
  (the simulator's tokenizer: 4 UTF-8 bytes per token), as batch pipelines that tokenize
  client-side do. Token ids let `prefix_cache` match the servers' exact KV events.
* unrelated: requests arrive as a Poisson process, each a prompt of its own (no prefix shared
  with any other beyond a few tokens), to `/generate` as `input_ids`. Nothing to reuse: what
  it shows is how a router spreads load, e.g. over the DP ranks of a server.

Texts are pseudo-English words from a seeded generator: about one token per 4 characters,
and distinct texts share no prefix beyond their first words.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from backends.sim.tokenizer import encode

CHAT_PATH = "/v1/chat/completions"
GENERATE_PATH = "/generate"
MODEL = "sim-model"

_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "de", "po", "an", "el", "or",
              "ju", "be", "ta", "qui", "zo", "fe", "ha")


def words(rng: random.Random, tokens: int) -> str:
    """About `tokens` tokens (4 characters each) of word-like text."""
    out: list[str] = []
    size = 0
    while size < 4 * tokens:
        word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[: 4 * tokens]


def zipf_weights(count: int, exponent: float) -> list[float]:
    raw = [1.0 / (rank + 1) ** exponent for rank in range(count)]
    total = sum(raw)
    return [w / total for w in raw]


def poisson_times(rng: random.Random, rate: float, duration: float) -> list[float]:
    """Arrival offsets in [0, duration) of a Poisson process of `rate` per second."""
    times: list[float] = []
    t = rng.expovariate(rate) if rate > 0 else duration
    while t < duration:
        times.append(t)
        t += rng.expovariate(rate)
    return times


@dataclass(frozen=True)
class ChatShape:
    system_prompts: int = 4
    system_tokens: int = 1500
    popularity: float = 1.0  # Zipf exponent over the system prompts
    turns: tuple[int, int] = (4, 10)  # per conversation, uniform
    user_tokens: tuple[int, int] = (40, 300)  # per user message, uniform
    max_tokens: int = 48  # reply length (the simulator always generates all of them)
    think_s: float = 2.0  # mean think time between a reply and the next turn (exponential)
    weights: tuple[float, ...] = ()  # popularity of each system prompt; () is Zipf(popularity)
    title: str = "System prompt"  # what starts each system prompt (then its index)

    @property
    def mean_turns(self) -> float:
        return (self.turns[0] + self.turns[1]) / 2


@dataclass(frozen=True)
class Conversation:
    start: float  # offset from the run's start
    system: str
    users: tuple[str, ...]
    thinks: tuple[float, ...]  # after each turn's reply


@dataclass(frozen=True)
class ChatPlan:
    shape: ChatShape
    conversations: tuple[Conversation, ...]
    system_of: tuple[int, ...]  # system prompt index of each conversation


def chat_plan(shape: ChatShape, rate: float, duration: float, seed: int,
              name: str = "chat") -> ChatPlan:
    """Conversations starting in [0, duration) so that about `rate` turns per second are sent;
    `name` seeds the generator apart from other workloads built on conversations."""
    rng = random.Random(f"{name}/{seed}")
    systems = [f"{shape.title} {i}. " + words(rng, shape.system_tokens)
               for i in range(shape.system_prompts)]
    weights = list(shape.weights) or zipf_weights(shape.system_prompts, shape.popularity)
    if len(weights) != shape.system_prompts:
        raise ValueError(f"{len(weights)} weights for {shape.system_prompts} system prompts")
    conversations, system_of = [], []
    for start in poisson_times(rng, rate / shape.mean_turns, duration):
        index = rng.choices(range(shape.system_prompts), weights)[0]
        turns = rng.randint(*shape.turns)
        users = tuple(words(rng, rng.randint(*shape.user_tokens)) for _ in range(turns))
        thinks = tuple(rng.expovariate(1.0 / shape.think_s) for _ in range(turns))
        conversations.append(Conversation(start, systems[index], users, thinks))
        system_of.append(index)
    return ChatPlan(shape, tuple(conversations), tuple(system_of))


def chat_body(messages: list[dict], max_tokens: int) -> dict:
    return {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}


@dataclass(frozen=True)
class FewshotShape:
    prefixes: int = 8
    prefix_tokens: int = 3000
    popularity: float = 1.0  # Zipf exponent over the prefixes
    question_tokens: tuple[int, int] = (10, 60)
    max_tokens: int = 16


@dataclass(frozen=True)
class FewshotRequest:
    at: float  # offset from the run's start
    prefix: int
    body: dict


@dataclass(frozen=True)
class FewshotPlan:
    shape: FewshotShape
    requests: tuple[FewshotRequest, ...]


def _fewshot_prefix(rng: random.Random, index: int, tokens: int) -> str:
    examples: list[str] = []
    size = 0
    while size < 4 * tokens:
        example = f"Q: {words(rng, 30)}?\nA: {words(rng, 50)}.\n\n"
        examples.append(example)
        size += len(example)
    text = f"Task {index}. Answer like the examples.\n\n" + "".join(examples)
    text = text[: 4 * tokens]
    return text + " " * (-len(text.encode()) % 4)  # whole tokens: questions start aligned


def fewshot_plan(shape: FewshotShape, rate: float, duration: float, seed: int) -> FewshotPlan:
    rng = random.Random(f"fewshot/{seed}")
    prefixes = [_fewshot_prefix(rng, i, shape.prefix_tokens) for i in range(shape.prefixes)]
    weights = zipf_weights(shape.prefixes, shape.popularity)
    requests = []
    for at in poisson_times(rng, rate, duration):
        index = rng.choices(range(shape.prefixes), weights)[0]
        question = f"Q: {words(rng, rng.randint(*shape.question_tokens))}?\nA:"
        body = {"input_ids": encode(prefixes[index] + question),
                "sampling_params": {"max_new_tokens": shape.max_tokens}, "stream": True}
        requests.append(FewshotRequest(at, index, body))
    return FewshotPlan(shape, tuple(requests))


@dataclass(frozen=True)
class UnrelatedShape:
    prompt_tokens: tuple[int, int] = (200, 800)  # uniform
    max_tokens: int = 16


@dataclass(frozen=True)
class UnrelatedPlan:
    shape: UnrelatedShape
    requests: tuple[FewshotRequest, ...]  # `prefix` is the request's own index


def unrelated_plan(shape: UnrelatedShape, rate: float, duration: float,
                   seed: int) -> UnrelatedPlan:
    rng = random.Random(f"unrelated/{seed}")
    requests = []
    for index, at in enumerate(poisson_times(rng, rate, duration)):
        body = {"input_ids": encode(words(rng, rng.randint(*shape.prompt_tokens))),
                "sampling_params": {"max_new_tokens": shape.max_tokens}, "stream": True}
        requests.append(FewshotRequest(at, index, body))
    return UnrelatedPlan(shape, tuple(requests))
