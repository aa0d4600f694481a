"""The one way the gateway stops a task from outside: an `Interrupt` with a reason.

asyncio can stop a task from the outside only by cancelling it. Several things must stop a
request's work early: the other PD leg failed, a stream went silent, a server was found dead
while a leg waited on it, the client left or stopped reading, the request was aborted. Each
of them calls `fire(reason)` on the interrupt of the task doing the work. That task catches
`CancelledError` at one place and calls `reason()`: it returns the exception to raise instead
(the interrupt's own cancellation is taken back with `uncancel`, as `asyncio.timeout` does), or
None when the cancellation came from somewhere else (shutdown, an outer interrupt), which the
task must then let propagate.

    interrupt = Interrupt()
    try:
        ...
    except asyncio.CancelledError:
        if (reason := interrupt.reason()) is not None:
            raise reason from None
        raise

Interrupts nest: an attempt's interrupt and the request's interrupt may both target one task;
each takes back only its own cancellation, so the outer one still sees its own.

An interrupt only works while its task waits inside the guarded code: it refuses to fire from
the task itself (the code is running and sees the failure itself) and after `close()` (the
guarded code is over). A cancellation requested then would hit the task's next, unrelated
await, since Python 3.11's `uncancel` cannot take a pending cancellation back.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.timers import Timers


class Interrupt:
    __slots__ = ("task", "_reason", "_taken", "_superseded", "_closed")

    def __init__(self, task: asyncio.Task | None = None,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        """`task`: the one to stop, else the current one (of `loop`, when the caller has it
        at hand: asking the running loop costs a getpid system call in CPython)."""
        self.task = task if task is not None else asyncio.current_task(loop)
        self._reason: BaseException | None = None
        self._taken = False
        self._superseded = False
        self._closed = False

    @property
    def fired(self) -> bool:
        return self._reason is not None

    def fire(self, reason: BaseException) -> bool:
        """Stop the task for `reason`; only the first reason counts. True if this one did."""
        if self._reason is not None or self._closed or self.task.done() \
                or asyncio.current_task() is self.task:
            return False
        self._reason = reason
        self.task.cancel()
        return True

    def close(self) -> None:
        """The guarded code is over: later fires do nothing."""
        self._closed = True

    def reason(self) -> BaseException | None:
        """In `except CancelledError`: the reason to raise, or None if the cancellation was
        not (only) ours. Takes our cancellation back once."""
        if self._reason is None:
            return None
        if not self._taken:
            self._taken = True
            self._superseded = self.task.uncancel() > 0  # cancelled by someone else too
        return None if self._superseded else self._reason


class Expired(TimeoutError):
    """The reason an interrupt gives when its `Deadline` passed."""


class Deadline:
    """Fire `interrupt` with `Expired` at loop time `when` (movable, cancellable); armed on
    the gateway's `Timers`, so arming and cancelling cost next to nothing."""

    __slots__ = ("interrupt", "when", "_timers", "_timer")

    def __init__(self, timers: Timers, interrupt: Interrupt, when: float) -> None:
        self.interrupt = interrupt
        self._timers = timers
        self.when = when
        self._timer = timers.at(when, self._expire)

    def move(self, when: float) -> None:
        """Now due at `when` instead: earlier re-arms the timer, later only notes it (the
        timer, when it comes, finds the deadline moved on and waits again)."""
        timer = self._timer
        if timer is None or when == self.when:
            return
        self.when = when
        if when < timer.when:
            timer.cancel()
            self._timer = self._timers.at(when, self._expire)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        timers = self._timers
        if self.when > timers.loop().time() + timers.resolution:  # moved later meanwhile
            self._timer = timers.at(self.when, self._expire)
            return
        self._timer = None
        self.interrupt.fire(Expired())
