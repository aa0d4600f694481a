"""The harder routing workloads, where approximate prefix routing is known to struggle.

Each is drawn once from its seed, so every target replays the same plan; the sizes and why
they are what they are are in docs/BENCHMARKS.md ("Harder routing workloads").

* hot: conversations on one 4K-token system prompt take 70% of the turns, the rest share three
  other prompts of the same size; short user turns (1-3 per conversation). The hot prompt's
  prefill work is more than one server can do at the full rate (every turn still prefills its
  own user message), so it must be spread over several servers, each holding a copy.
* docqa: many users ask short questions (plus up to two follow-ups) about a few 16K-token
  documents (Zipf popularity), the document being the system message. A server's cache holds
  two documents, the cluster's all of them: a router must not put three on one server.
* agent: agent loops on `/generate` with token ids (as agent runtimes and RL rollouts that keep
  the context as ids do): a shared tool-definition prompt of the agent's kind, a task, then
  steps whose prompt is the whole context so far plus the model's last tool call and the
  tool's output (hundreds to thousands of tokens), sent after a short tool latency. Contexts
  grow to ~12K tokens on average (18K at most with seed 0); one server's cache holds a few
  live sessions, the cluster all of them.

hot and docqa are conversations (`ChatPlan`, replayed by `drive.drive_chat`); agent has
its own plan, replayed by `drive.drive_agent`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from backends.sim.tokenizer import encode
from loadtests.routing.workloads import ChatPlan, ChatShape, chat_plan, poisson_times, words

# 4 prompts of 4,096 tokens; 70% of the conversations on the first (the rest 10% each).
HOT = ChatShape(system_prompts=4, system_tokens=4096, weights=(0.7, 0.1, 0.1, 0.1),
                turns=(1, 3), user_tokens=(100, 500), max_tokens=16, think_s=0.5,
                title="Assistant")
# 6 documents of 16,384 tokens, Zipf popularity 41/20/14/10/8/7%.
DOCQA = ChatShape(system_prompts=6, system_tokens=16384, popularity=1.0, turns=(1, 3),
                  user_tokens=(10, 60), max_tokens=32, think_s=1.5, title="Document")
HOT_QUICK = ChatShape(system_prompts=3, system_tokens=800, weights=(0.7, 0.15, 0.15),
                      turns=(1, 3), user_tokens=(30, 100), max_tokens=4, think_s=0.1,
                      title="Assistant")
DOCQA_QUICK = ChatShape(system_prompts=3, system_tokens=1500, popularity=1.0, turns=(1, 2),
                        user_tokens=(10, 30), max_tokens=4, think_s=0.2, title="Document")


def hot_plan(shape: ChatShape, rate: float, duration: float, seed: int) -> ChatPlan:
    return chat_plan(shape, rate, duration, seed, name="hot")


def docqa_plan(shape: ChatShape, rate: float, duration: float, seed: int) -> ChatPlan:
    return chat_plan(shape, rate, duration, seed, name="docqa")


@dataclass(frozen=True)
class AgentShape:
    kinds: int = 2  # agent kinds, each with its own tool-definition prompt (uniform popularity)
    system_tokens: int = 2000
    task_tokens: tuple[int, int] = (100, 400)  # uniform
    steps: tuple[int, int] = (6, 14)  # requests per session, uniform
    tool_tokens: tuple[int, int] = (300, 3000)  # tool output per step, log-uniform
    max_tokens: int = 32  # the model's tool call
    tool_s: tuple[float, float] = (0.05, 0.3)  # tool latency before the next step, uniform

    @property
    def mean_steps(self) -> float:
        return (self.steps[0] + self.steps[1]) / 2


AGENT = AgentShape()
AGENT_QUICK = AgentShape(kinds=1, system_tokens=300, task_tokens=(30, 80), steps=(3, 5),
                         tool_tokens=(100, 400), max_tokens=4, tool_s=(0.01, 0.05))


@dataclass(frozen=True)
class AgentSession:
    start: float  # offset from the run's start
    kind: int
    prompt: tuple[int, ...]  # tool definitions + task, token ids
    tools: tuple[tuple[int, ...], ...]  # tool output after step i (i < steps - 1), token ids
    waits: tuple[float, ...]  # tool latency after step i

    @property
    def steps(self) -> int:
        return len(self.tools) + 1


@dataclass(frozen=True)
class AgentPlan:
    shape: AgentShape
    sessions: tuple[AgentSession, ...]


def _log_uniform(rng: random.Random, low: int, high: int) -> int:
    return round(low * (high / low) ** rng.random())


def agent_plan(shape: AgentShape, rate: float, duration: float, seed: int) -> AgentPlan:
    """Sessions starting in [0, duration) so that about `rate` steps per second are sent."""
    rng = random.Random(f"agent/{seed}")
    systems = [encode(_whole(f"Agent {k}. Tools:\n" + words(rng, shape.system_tokens)))
               for k in range(shape.kinds)]
    sessions = []
    for start in poisson_times(rng, rate / shape.mean_steps, duration):
        kind = rng.randrange(shape.kinds)
        task = encode(_whole(f"\nTask: {words(rng, rng.randint(*shape.task_tokens))}\n"))
        steps = rng.randint(*shape.steps)
        tools = tuple(tuple(encode(_whole(
            f"\nTool result: {words(rng, _log_uniform(rng, *shape.tool_tokens))}\n")))
            for _ in range(steps - 1))
        waits = tuple(rng.uniform(*shape.tool_s) for _ in range(steps - 1))
        sessions.append(AgentSession(start, kind, tuple(systems[kind] + task), tools, waits))
    return AgentPlan(shape, tuple(sessions))


def _whole(text: str) -> str:
    """`text` padded to whole tokens (4 bytes), so that concatenated ids stay exact text."""
    return text + " " * (-len(text.encode()) % 4)


def agent_body(context: list[int], max_tokens: int) -> dict:
    return {"input_ids": context, "sampling_params": {"max_new_tokens": max_tokens},
            "stream": True}
