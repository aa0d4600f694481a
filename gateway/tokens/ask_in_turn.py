"""A question for one of a model's servers that any of them can answer in milliseconds (its
tokenizer's count of a prompt): `/v1/messages/count_tokens` (`anthropic/endpoint.py`) and the
context check's `/v1/tokenize` (`context_check.py`) ask it the same way.

The decodes, then the prefills, each list starting one further on per question (so a hung
server is first for few questions, and no one server takes them all). A server that fails
(its ask raises `NoAnswer`: a 5xx, no connection) hands over at once; one silent for its head
start (1 s) keeps its question but the next server is asked too (a hedge), and the first
answer wins. The whole question ends by its deadline: then, or with every server failed,
`NoAnswer` saying why, and the slower servers' requests end with it. A server's tokenizer is
given a second more per 4 MiB of question, on both the head start and the deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Protocol, TypeVar

HEAD_START_S = 1.0  # a count takes milliseconds: a server silent this long is likely hung
BYTES_PER_S = 4 << 20  # a server's tokenizer is given a second per 4 MiB of prompt
ROLES = ("decode", "prefill")  # asked in this order

S = TypeVar("S")
T = TypeVar("T")


class NoAnswer(Exception):
    """Why a server (raised by an ask) or every server (raised by `InTurn.ask`) gave none."""


class ServedModel(Protocol):
    def usable(self, role: str) -> list: ...


class InTurn:
    """One kind of question, asked of the servers in turn; `turn` rotates the first asked."""

    def __init__(self, head_start: float = HEAD_START_S) -> None:
        self.head_start = head_start
        self.turn = 0

    def servers(self, model: ServedModel) -> list:
        """The model's usable decodes, then its prefills, each list rotated one further on."""
        self.turn += 1
        return [s for role in ROLES for s in _rotated(model.usable(role), self.turn)]

    async def ask(self, servers: Sequence[S], ask: Callable[[S], Coroutine[Any, Any, T]],
                  seconds: float, size: int = 0) -> T:
        """The first answer of `servers`, asked as the module says, within `seconds` (plus a
        second per 4 MiB of `size`, the question's bytes); else NoAnswer."""
        extra = size / BYTES_PER_S
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds + extra
        waiting, asked = list(servers), set()
        last = "no usable server"
        try:
            while waiting or asked:
                if waiting:  # the first, or the one after a failure or a silent head start
                    asked.add(asyncio.create_task(ask(waiting.pop(0))))
                left = deadline - loop.time()
                if left <= 0:
                    last = f"no answer in {seconds + extra:.1f} s"
                    break
                done, asked = await asyncio.wait(
                    asked, timeout=min(left, self.head_start + extra) if waiting else left,
                    return_when=asyncio.FIRST_COMPLETED)
                answered = [task for task in done if not isinstance(task.exception(), NoAnswer)]
                if answered:
                    return answered[0].result()  # (another exception is raised as it is)
                last = str(next(iter(done)).exception()) if done else last
        finally:  # the slower servers' requests end with the question
            for task in asked:
                task.cancel()
            await asyncio.gather(*asked, return_exceptions=True)
        raise NoAnswer(last)


def _rotated(servers: list, turn: int) -> list:
    """`servers` starting at the `turn`-th (modulo their number)."""
    k = turn % len(servers) if servers else 0
    return servers[k:] + servers[:k]
