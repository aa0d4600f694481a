"""The request path cut short at each stage of its dispatch, for a measurement (`logic_cost
--configs NAME`, `instruction_cost --configs NAME`), never for serving.

Each stage answers every request 200 with the decode's answer where the request would go on,
so that the difference between two stages is what the part between them costs:

* `endpoint`: `Proxy.handle` answers at once: the endpoint layer alone (key, class, body,
  parsing, admission, the in-flight table, the answer and its metrics);
* `picked`: the attempt loop picks the pair and prepares the attempt (rooms, both bodies),
  then `PDDispatcher.run` answers at once;
* `counted`: and the ledger takes and gives back the attempt's counters and policy hooks
  (`Ledger.opened`, `Ledger.leg_done` for both legs), no leg sent;
* `decode-leg`: and the decode leg runs (its interrupt, request, whole answer, progress and
  learning), without the prefill leg, its task and the first-progress deadline;
* `no-deadline`: the whole request with the first-progress deadline (the learned deadline,
  the queue watch, its timer) replaced by nothing;
* `default` (logic_cost's own): the whole request.

Stages patch the gateway built for the measurement (and, for `no-deadline`, one module
function, put back when the block ends).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from gateway.cancel import Interrupt
from gateway.dispatch import pd
from gateway.dispatch.attempt import Answer, Attempt

STAGES = ("endpoint", "picked", "counted", "decode-leg", "no-deadline")


class _NoDeadline:
    """What `first_deadline` gives when the stage takes the deadline away."""

    when = float("inf")

    def move(self, when: float) -> None:
        pass

    def cancel(self) -> None:
        pass

    def queued(self) -> bool:
        return False


@contextlib.contextmanager
def cut(gateway, stage: str, body: bytes) -> Iterator[None]:
    """`gateway`'s request path cut short at `stage` while the block runs."""
    dispatcher = gateway.dispatcher
    ledger = dispatcher.ledger

    async def answer(*_args, **_kwargs) -> Answer:
        await asyncio.sleep(0)  # one loop turn, as a leg's answer takes
        return Answer(200, b"application/json", body)

    async def sent_alone(attempt: Attempt) -> Answer:
        """The decode leg without the prefill's, its task or the first-progress deadline."""
        loop = dispatcher.timers.loop()
        attempt.interrupt = Interrupt(loop=loop)
        attempt.started_at = loop.time()
        _, answered = await dispatcher._decode_leg(attempt)
        return answered

    def counted(send):
        """An attempt whose counters are taken, `send` awaited, and given back per leg."""

        async def run(attempt: Attempt, by_policy: bool = False) -> Answer:
            ledger.opened(attempt, by_policy)
            answered = await send(attempt)
            ledger.leg_done(attempt, "prefill", True)
            ledger.leg_done(attempt, "decode", True)
            return answered

        return run

    runs = {"picked": answer, "counted": counted(answer), "decode-leg": counted(sent_alone)}
    original = pd.first_deadline
    if stage == "endpoint":
        gateway.proxy.handle = answer
    elif stage in runs:
        dispatcher.run = runs[stage]
    elif stage == "no-deadline":
        pd.first_deadline = lambda *_args, **_kwargs: _NoDeadline()
        dispatcher.model.first_progress_deadline = lambda *_args, **_kwargs: 30.0
    else:
        raise ValueError(f"unknown stage {stage!r}; of {', '.join(STAGES)}")
    try:
        yield
    finally:
        pd.first_deadline = original
