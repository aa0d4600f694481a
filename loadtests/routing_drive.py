"""Replay a workload plan against one proxy: open-loop arrivals, closed-loop conversations.

Conversations (and few-shot requests) start at their planned offsets whatever the proxy's
speed; inside a conversation each turn waits for the previous reply and a think time, as a
chat client does. Nothing new starts after `duration`; what is in flight then is awaited
(each request is bounded by `timeout`). A failed turn ends its conversation (its history would
lack the reply).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from loadtests.routing_client import Reply, stream
from loadtests.routing_workloads import (
    CHAT_PATH,
    GENERATE_PATH,
    ChatPlan,
    Conversation,
    FewshotPlan,
    chat_body,
)


@dataclass(frozen=True)
class Sample:
    sent: float  # offset from the run's start
    turn: int  # 0 for few-shot requests
    reply: Reply


@dataclass(frozen=True)
class Drive:
    samples: list[Sample]
    elapsed: float  # from the start to the last answer


async def _sleep_until(start: float, offset: float) -> None:
    delay = start + offset - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


async def _conversation(port: int, conv: Conversation, max_tokens: int, start: float,
                        duration: float, timeout: float, out: list[Sample]) -> None:
    await _sleep_until(start, conv.start)
    messages = [{"role": "system", "content": conv.system}]
    for turn, (user, think) in enumerate(zip(conv.users, conv.thinks, strict=True)):
        sent = time.perf_counter() - start
        if sent >= duration:
            return
        messages.append({"role": "user", "content": user})
        reply = await stream(port, CHAT_PATH, chat_body(messages, max_tokens), timeout)
        out.append(Sample(sent, turn, reply))
        if not reply.ok:
            return
        messages.append({"role": "assistant", "content": reply.text})
        await asyncio.sleep(think)


async def drive_chat(port: int, plan: ChatPlan, duration: float, timeout: float) -> Drive:
    out: list[Sample] = []
    start = time.perf_counter()
    await asyncio.gather(*(
        _conversation(port, conv, plan.shape.max_tokens, start, duration, timeout, out)
        for conv in plan.conversations))
    return Drive(out, _elapsed(out))


async def _one(port: int, at: float, body: dict, start: float, timeout: float,
               out: list[Sample]) -> None:
    await _sleep_until(start, at)
    reply = await stream(port, GENERATE_PATH, body, timeout)
    out.append(Sample(at, 0, reply))


async def drive_fewshot(port: int, plan: FewshotPlan, duration: float, timeout: float) -> Drive:
    out: list[Sample] = []
    start = time.perf_counter()
    await asyncio.gather(*(_one(port, r.at, r.body, start, timeout, out)
                           for r in plan.requests if r.at < duration))
    return Drive(out, _elapsed(out))


def _elapsed(samples: list[Sample]) -> float:
    return max((s.sent + s.reply.latency for s in samples), default=0.0)
