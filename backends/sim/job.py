"""One generation unit (a single prompt, or one item of a batch) and its state.

The engine appends tokens, the PD flow sets errors, and the HTTP layer reads
snapshots. Two wake-ups, both cheap when nobody listens:

- `wait()`/`wake()`: the job's own flow sleeps until something it waits for
  may have happened (prefill done, the job ended, its bootstrap room changed,
  a deadline passed); it then rechecks its condition, like a condition variable.
  One future per sleep, no asyncio.Event, no task.
- `changed`: an Event shared by the jobs of one streaming or batch HTTP
  request, set on every token; None on the single-item fast path, whose
  answer is written once the flow returns.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from backends.sim import tokenizer


class SimError(Exception):
    """A request failure with the HTTP status SGLang would give it."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class ItemSpec:
    """The normalized input of one item (GenerateReqInput after `__getitem__`)."""

    index: int
    rid: str
    input_ids: list[int]
    text: str | None
    max_new_tokens: int
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    stream: bool = False
    routed_dp_rank: int | None = None
    disagg_prefill_dp_rank: int | None = None
    sample_key: bytes | None = None  # None: greedy; else mixed into the seed (sampling)


ABORT_REASON = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


@dataclass(eq=False)
class Job:
    spec: ItemSpec
    seed: bytes = b""
    cached_tokens: int = 0
    remaining_prefill: int = 0
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: dict[str, Any] | None = None
    error: SimError | None = None
    cancelled: bool = False
    aborted: bool = False
    phase: str = "new"
    prefilled: bool = False  # the first token exists (set by the engine)
    created: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    changed: asyncio.Event | None = None
    task: asyncio.Task[Any] | None = None  # runs the flow; cancelled by abort or disconnect
    rank: int = 0  # the DP rank serving it (dp.py)
    # decode mode: the prefill's first token, held until the request joins a batch (engine._admit)
    first: tuple[int, float] | None = None
    _waiter: asyncio.Future[None] | None = None

    def __post_init__(self) -> None:
        if not self.seed:
            self.seed = tokenizer.prompt_seed(self.spec.input_ids)
            if self.spec.sample_key is not None:
                self.seed = tokenizer.sample_seed(self.seed, self.spec.sample_key)

    async def wait(self) -> None:
        """Sleep until the next `wake()`; the caller rechecks what it waits for."""
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def wake(self, *_: object) -> None:
        """Resume the flow if it sleeps (arguments ignored: usable as a room listener)."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    @property
    def prompt_tokens(self) -> int:
        return len(self.spec.input_ids)

    @property
    def context_len(self) -> int:
        return len(self.spec.input_ids) + len(self.output_ids)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None or self.cancelled

    def add_token(self, token: int, logprob: float) -> None:
        """Append one generated token and decide whether the item finished."""
        now = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = now
        self.output_ids.append(token)
        self.output_logprobs.append(logprob)
        spec = self.spec
        if token in spec.stop_token_ids:
            self._finish({"type": "stop", "matched": token})
            return
        before = len(self.text)
        self.text += tokenizer.token_text(token)
        for stop in spec.stop:
            at = self.text.find(stop, max(0, before - len(stop) + 1))
            if stop and at >= 0:
                self.text = self.text[:at]
                self._finish({"type": "stop", "matched": stop})
                return
        if len(self.output_ids) >= spec.max_new_tokens:
            self._finish({"type": "length", "length": spec.max_new_tokens})
            return
        if self.changed is not None:
            self.changed.set()

    def next_token(self) -> None:
        """Generate the token at the next output position."""
        token, logprob = tokenizer.output_token(self.seed, len(self.output_ids))
        self.add_token(token, logprob)

    def stage_first_token(self) -> None:
        """Prefill mode: keep the first token without finishing or notifying.

        A prefill answers only once its KV has left, with finish length 0.
        """
        token, logprob = tokenizer.output_token(self.seed, 0)
        self.first_token_at = time.perf_counter()
        self.output_ids.append(token)
        self.output_logprobs.append(logprob)
        self.text = tokenizer.token_text(token)

    def _finish(self, reason: dict[str, Any]) -> None:
        self.finish_reason = reason
        self._end()

    def _end(self) -> None:
        self.finished_at = time.perf_counter()
        self.phase = "done"
        self.prefilled = True
        if self.changed is not None:
            self.changed.set()
        self.wake()

    def finish(self, reason: dict[str, Any]) -> None:
        if not self.done:
            self._finish(reason)

    def fail(self, error: SimError) -> None:
        if not self.done:
            self.error = error
            self._end()

    def cancel(self) -> None:
        """The client went away: stop without an answer."""
        if not self.done:
            self.cancelled = True
            self._end()
