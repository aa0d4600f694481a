"""Replay a workload plan through a sender: open-loop arrivals, closed-loop sessions.

Conversations, agent sessions and few-shot requests start at their planned offsets whatever the
router's speed; inside a session each request waits for the previous reply and a think time
(or a tool's latency), as a chat client or an agent does. Nothing new starts after `duration`;
what is in flight then is awaited (each request is bounded by the sender's timeout). A failed
request ends its session (the context would lack the reply).

A sender (`Send`) takes the path, the body and the session's key (its index in the plan: a
router that knows the plan's structure, `oracle.Oracle`, routes on it; a proxy,
`via_proxy`, ignores it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from backends.sim.tokenizer import encode
from loadtests.routing.client import Reply, stream
from loadtests.routing.hard_workloads import AgentPlan, AgentSession, agent_body
from loadtests.routing.workloads import (
    CHAT_PATH,
    GENERATE_PATH,
    ChatPlan,
    Conversation,
    FewshotPlan,
    chat_body,
)

Send = Callable[[str, dict, int], Awaitable[Reply]]


def via_proxy(port: int, timeout: float) -> Send:
    """Every request to the proxy on 127.0.0.1:port, which picks the servers."""
    async def send(path: str, body: dict, key: int) -> Reply:
        return await stream(port, path, body, timeout)
    return send


@dataclass(frozen=True)
class Sample:
    sent: float  # offset from the run's start
    turn: int  # 0 for few-shot requests; the step of an agent session
    reply: Reply


@dataclass(frozen=True)
class Drive:
    samples: list[Sample]
    elapsed: float  # from the start to the last answer


async def _sleep_until(start: float, offset: float) -> None:
    delay = start + offset - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


async def _conversation(send: Send, key: int, conv: Conversation, max_tokens: int,
                        start: float, duration: float, out: list[Sample]) -> None:
    await _sleep_until(start, conv.start)
    messages = [{"role": "system", "content": conv.system}]
    for turn, (user, think) in enumerate(zip(conv.users, conv.thinks, strict=True)):
        sent = time.perf_counter() - start
        if sent >= duration:
            return
        messages.append({"role": "user", "content": user})
        reply = await send(CHAT_PATH, chat_body(messages, max_tokens), key)
        out.append(Sample(sent, turn, reply))
        if not reply.ok:
            return
        messages.append({"role": "assistant", "content": reply.text})
        await asyncio.sleep(think)


async def drive_chat(send: Send, plan: ChatPlan, duration: float) -> Drive:
    out: list[Sample] = []
    start = time.perf_counter()
    await asyncio.gather(*(
        _conversation(send, key, conv, plan.shape.max_tokens, start, duration, out)
        for key, conv in enumerate(plan.conversations)))
    return Drive(out, _elapsed(out))


async def _one(send: Send, key: int, at: float, body: dict, start: float,
               out: list[Sample]) -> None:
    await _sleep_until(start, at)
    reply = await send(GENERATE_PATH, body, key)
    out.append(Sample(at, 0, reply))


async def drive_fewshot(send: Send, plan: FewshotPlan, duration: float) -> Drive:
    out: list[Sample] = []
    start = time.perf_counter()
    await asyncio.gather(*(_one(send, key, r.at, r.body, start, out)
                           for key, r in enumerate(plan.requests) if r.at < duration))
    return Drive(out, _elapsed(out))


async def _agent(send: Send, key: int, session: AgentSession, max_tokens: int, start: float,
                 duration: float, out: list[Sample]) -> None:
    """One agent loop: the context grows by the model's tool call and the tool's output."""
    await _sleep_until(start, session.start)
    context = list(session.prompt)
    for step in range(session.steps):
        sent = time.perf_counter() - start
        if sent >= duration:
            return
        reply = await send(GENERATE_PATH, agent_body(context, max_tokens), key)
        out.append(Sample(sent, step, reply))
        if not reply.ok or step == session.steps - 1:
            return
        # The sim's words are whole 4-byte tokens: encode(text) is the generated ids.
        context += encode(reply.text) + list(session.tools[step])
        await asyncio.sleep(session.waits[step])


async def drive_agent(send: Send, plan: AgentPlan, duration: float) -> Drive:
    out: list[Sample] = []
    start = time.perf_counter()
    await asyncio.gather(*(
        _agent(send, key, s, plan.shape.max_tokens, start, duration, out)
        for key, s in enumerate(plan.sessions)))
    return Drive(out, _elapsed(out))


def _elapsed(samples: list[Sample]) -> float:
    return max((s.sent + s.reply.latency for s in samples), default=0.0)
