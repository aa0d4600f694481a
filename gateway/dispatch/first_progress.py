"""The deadline of an attempt's first progress: learned, and kept while the attempt is queued.

The learned deadline (gateway/health/deadlines.py) is when the attempt is first looked at,
not when it is cut: a `QueueWatch` (gateway/health/queue_wait.py) then tells a request that
waits its turn on a busy server from one stuck on a silent one, and re-arms the deadline one
learned window later while it is queued, up to the hard limit (`cap`: the response timeout,
the request's own deadline). The attempt's first progress ends the watch (`PDDispatcher.
progress` moves the deadline to the limits that follow). From then on the attempt waits on its
decode alone (its KV is there): a `DecodeQueue` keeps it, past those limits, while the decode
works through an admission queue (SGLang admits into its running batch only what fits), up to
the same hard limit.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from gateway.cancel import Deadline, Interrupt
from gateway.dispatch.attempt import Attempt
from gateway.health.queue_wait import DecodeQueue, QueueWatch, shortest_wait
from gateway.timers import Timers


class FirstProgressDeadline(Deadline):
    """A `Deadline` that asks its watch, when due, whether the attempt is only queued.

    `decode` (with its chunk-gap ring `gaps` and the least window `floor`): the decode whose
    admission queue may keep the attempt once its KV is there; its `DecodeQueue` is built at
    the first look at such a silence (most attempts never have one)."""

    __slots__ = ("watch", "cap", "decode", "gaps", "floor", "decode_queue", "silence")

    def __init__(self, timers: Timers, interrupt: Interrupt, when: float, cap: float,
                 watch: QueueWatch | None, decode=None, gaps=None, floor: float = 0.0) -> None:
        self.watch = watch
        self.cap = cap
        self.decode, self.gaps, self.floor = decode, gaps, floor
        self.decode_queue: DecodeQueue | None = None
        self.silence: tuple[float, float] | None = None  # (since, window) on the decode alone
        super().__init__(timers, interrupt, min(when, cap))

    def move(self, when: float) -> None:
        """Moved by the attempt's progress: the watch is over; what follows is a silence on
        its decode, bounded by `when` unless the decode is seen to work through a queue."""
        self.watch = None
        now = self._timers.loop().time()
        self.silence = (now, when - now)
        super().move(when)

    def queued(self) -> bool:
        return self.watch is not None and self.watch.queued()

    def _expire(self) -> None:
        watch, timers = self.watch, self._timers
        now = timers.loop().time()
        if self.when > now + timers.resolution or now >= self.cap - timers.resolution:
            super()._expire()  # moved on meanwhile, or at the hard limit
            return
        mono = time.monotonic()
        later = None
        if watch is not None:
            later = watch.look(mono)
            if later is None:
                self.watch = None
            else:
                later = now + later - mono
        elif self.decode is not None and self.silence is not None:
            since, window = self.silence
            later = self._decode_queue().look(since, now, window, mono - now)
        if later is not None:
            self.when = min(self.cap, max(later, now + timers.resolution))
        super()._expire()

    def _decode_queue(self) -> DecodeQueue:
        queue = self.decode_queue
        if queue is None:
            # the decode's progress for its other requests: chunks it streamed, legs it
            # answered or finished (a queue of long answers may finish none for many seconds)
            decode, gaps = self.decode, self.gaps
            queue = self.decode_queue = DecodeQueue(
                decode, lambda: (gaps.count if gaps is not None else 0) + decode.last_success,
                least=self.floor)
        return queue


def first_deadline(timers: Timers, attempt: Attempt, first: float, response: float,
                   peers: Callable[[], list | None], gaps=None,
                   floor: float = 0.0) -> FirstProgressDeadline:
    """The first-progress deadline of `attempt`, started now, looked at after `first`.
    `gaps`: the decode's chunk-gap ring (health/deadlines.py), whose count of its streams'
    chunks is part of the progress that tells a decode working through its queue from a
    stuck one. `floor`: the ordinary deadlines' floor, the least window in which a queue's
    signs of life count (a request's own `first` is shorter after its silences)."""
    prefill = attempt.prefill
    tokens = attempt.prefill_tokens

    def elsewhere() -> float:
        return shortest_wait(peers() or (), prefill, tokens)

    decode = attempt.decode
    watch = QueueWatch(attempt.prefill_target or prefill, decode, tokens, first,
                       time.monotonic(), elsewhere, floor)
    started = attempt.started_at
    return FirstProgressDeadline(timers, attempt.interrupt, started + first,
                                 min(started + response, attempt.not_after), watch, decode,
                                 gaps, floor)
