"""Queued is not hung: what an attempt without first progress is waiting for.

Under overload every prefill queue outgrows any fixed first-progress deadline. Cutting a
request that only waits its turn sends it to the back of another queue, where it computes its
prefill again: a retry storm that deepens the overload it reacts to. So once an attempt's
learned deadline (gateway/health/deadlines.py) passes without progress, it is looked at
again, and again every learned deadline (`window`) after, and kept while it is queued:

* **Its place in the queue.** As of dispatch, the work ahead of it on its prefill (server or
  DP rank) is the larger of the server's `/v1/loads` waiting uncached tokens and this
  gateway's own in-flight prompt tokens there (every worker's), less its own. The server's
  cumulative count of prefilled tokens (`total_prefill_uncached_tokens`) then says when that
  work is done: the attempt's *mark* is the count at dispatch plus the work ahead. Below the
  mark it is still queued behind older work.
* **Silence is a hang, a busy server is not.** At each look the prefill must have moved since
  the previous look (its count grew, or a prefill leg of ours succeeded there) and the decode
  must have answered a `/v1/loads` poll or a request since then. A server that does neither
  (frozen, its scheduler stuck, health checks hanging) is cut at once: a hang is detected as
  before, within one learned deadline.
* **Its predicted turn.** The work ahead at the prefill's measured speed, twice over
  (`QUEUE_FACTOR`), is as long as it stays queued below its mark: work ahead that never gets
  done (requests stuck on a hung decode, which the gateway still counts in flight) keeps
  nothing waiting past it.
* **Its turn came.** Past the mark (or its predicted turn) the attempt should start; it is given the learned deadline
  from its turn, or longer when every other prefill would make it wait longer (its queue and
  this prompt at that server's measured speed): waiting here costs less than the back of a
  longer queue (the rent-or-buy rule: wait as long as the move would cost). A decode that
  holds a queue of its own (requests waiting, or its KV pool nearly full) while it finishes
  requests is its admission queue: also waiting, not hung.

Without the server's counters (loads polling off, or a server that does not report them) none
of this can be judged, and the learned deadline cuts the attempt as before.

A request can also queue on its decode once its KV is there (`DecodeQueue`): SGLang admits it
into the running batch only while the batch and the KV pool have room, and retracts running
requests when the pool runs out; the simulator streams a request's first token as its KV
arrives and only then queues it for the batch. Past capacity such a request is silent (before
its first chunk, or between two chunks of its stream) longer than any learned gap while its
decode keeps serving others: cut, it would start over on another pair, its prefill repeated,
and five such cuts open the decode's breaker, whose rescue stops every stream on it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

DECODE_FULL = 0.9  # token usage from which a decode admits only as requests finish
QUEUE_FACTOR = 2.0  # slack on a predicted queue wait (the speed and the work ahead drift)
PROBE = 0.5  # of a window: at the first look at a silence, how long the decode gets to move


def counted(target) -> bool:
    """Whether the target's snapshot carries the cumulative prefill counters."""
    load = target.load
    return load.updated_at > 0.0 and (load.prefill_tokens > 0 or load.prefill_busy_us > 0)


def queued_ahead(target, own: int = 0) -> int:
    """Uncached prompt tokens waiting on the prefill `target` before a request of `own`
    tokens already counted in its in-flight figures."""
    reported = target.load.waiting_uncached_tokens if target.load.updated_at > 0.0 else 0
    return max(reported, target.totals()[1] - own, 0)


def predicted_wait(target, tokens: int, own: int = 0) -> float | None:
    """Seconds until a request of `tokens` uncached tokens sent to `target` now is prefilled:
    the work ahead plus its own at the target's measured speed; None: speed not measured."""
    speed = target.load.prefill_speed
    if speed <= 0.0:
        return None
    return (queued_ahead(target, own) + tokens) / speed


def shortest_wait(servers: Iterable, here, tokens: int) -> float:
    """The shortest `predicted_wait` of `tokens` on another usable prefill of `here`'s model
    (0 when none is known: a retry may be as fast as waiting)."""
    best = None
    for server in servers:
        if server is here or not server.usable or server.model != here.model:
            continue
        wait = predicted_wait(server, tokens)
        if wait is None:
            return 0.0
        best = wait if best is None else min(best, wait)
    return 0.0 if best is None else best


class QueueWatch:
    """The looks at one attempt without progress (monotonic times); see the module doc."""

    __slots__ = ("prefill", "decode", "window", "heard", "mark", "seen", "started", "moved_at",
                 "turn_at", "elsewhere", "counted", "ahead", "due")

    def __init__(self, prefill, decode, own: int, window: float, started: float,
                 elsewhere: Callable[[], float], heard: float | None = None) -> None:
        self.prefill = prefill  # the prefill target: a Server or its DP rank
        self.decode = decode
        self.window = window
        # how recent the servers' signs of life must be (a poll answered, a leg finished):
        # at least the ordinary deadline, even when the request's own is shorter (`urgency`,
        # deadlines.py), which may be shorter than the polls' interval
        self.heard = max(window, heard or 0.0)
        self.elsewhere = elsewhere  # the shortest predicted wait on another prefill
        self.counted = counted(prefill)
        self.ahead = queued_ahead(prefill, own)
        self.seen = prefill.load.prefill_tokens
        self.mark = self.seen + self.ahead
        self.started = started
        self.moved_at = started  # when the prefill was last seen to move (from dispatch on)
        self.turn_at = started if self.ahead == 0 else None
        # its predicted turn, with slack: the work ahead at the measured speed, QUEUE_FACTOR
        # times (work ahead that never gets done, such as requests stuck on a hung decode,
        # keeps no attempt queued past it)
        # (its speed not measured yet, a few seconds after start: the mark alone decides)
        speed = prefill.load.prefill_speed
        self.due = started + (QUEUE_FACTOR * self.ahead / speed if speed > 0.0
                              else math.inf if self.ahead else 0.0)

    def queued(self) -> bool:
        """Whether it is queued now: the work ahead of it at dispatch not all done, and its
        prefill seen to move since the dispatch, within the last window (a server that
        froze before or since shows nothing: its attempts are no longer queued)."""
        now = time.monotonic()
        return (self.counted and self.seen < self.mark and self.moved_at > self.started
                and now - self.moved_at < self.heard and now < self.due + self.heard)

    def look(self, now: float) -> float | None:
        """The time of the next look, or None: cut the attempt now."""
        if not self.counted:
            return None
        load = self.prefill.load
        if load.prefill_tokens > self.seen:  # the snapshot asked at `updated_at` saw it move
            self.seen = load.prefill_tokens
            self.moved_at = max(self.moved_at, load.updated_at)
        decode = self.decode
        heard = min(max(self.moved_at, self.prefill.server.last_success),
                    max(decode.load.updated_at, decode.last_success))
        recent = self.heard
        if heard + recent <= now:
            return None  # a silent server: a hang
        if self.seen < self.mark and now < self.due + recent:
            return heard + recent  # queued behind work that is being done
        if self.turn_at is None:  # its turn came by this snapshot, or is past due
            self.turn_at = load.updated_at if self.seen >= self.mark else self.due
        dload = decode.load
        if (dload.waiting > 0 or dload.token_usage >= DECODE_FULL) \
                and decode.last_success + recent > now:
            return heard + recent  # in its decode's admission queue, which moves
        until = self.turn_at + max(self.window, self.elsewhere())
        return min(until, heard + recent) if until > now else None


class DecodeQueue:
    """The looks at a request silent on its decode after its KV arrived (monotonic times).

    Kept, one look after another, while the decode is seen to work through a queue: its last
    `/v1/loads` answer came within the last `window` and shows requests waiting (or its KV
    pool DECODE_FULL), and `progress` (a figure that grows with what the decode does for its
    other requests: their chunks, legs it finished) moved since the previous look. The first
    look at a silence only notes `progress` and looks again PROBE window later. A frozen decode (its
    polls hang), an idle one, or one whose other requests stand still too is cut: within one
    window of its last answered poll. Never past `hard` seconds of silence."""

    __slots__ = ("decode", "progress", "hard", "least", "since", "seen")

    def __init__(self, decode, progress: Callable[[], float], hard: float = math.inf,
                 least: float = 0.0) -> None:
        self.decode = decode
        self.progress = progress
        self.hard = hard
        self.least = least  # the least window: the ordinary deadline's floor (as `QueueWatch.heard`)
        self.since: float | None = None  # the silence the last look was at
        self.seen = 0.0  # `progress` at that look

    def look(self, since: float, now: float, window: float, skew: float = 0.0) -> float | None:
        """The next look at a silence that began at `since`, or None: cut it now. `skew`:
        time.monotonic() less the clock of `since` and `now` (an event loop's)."""
        end = since + self.hard
        window = max(window, self.least)
        load = self.decode.load
        heard = load.updated_at - skew
        if now >= end or load.updated_at <= 0.0 or heard + window <= now \
                or not (load.waiting > 0 or load.token_usage >= DECODE_FULL):
            return None  # silent, no queue to wait in, or waited the most
        moved = self.progress()
        if since != self.since:  # a new silence: watch the decode's progress from here
            self.since, self.seen = since, moved
            return min(now + PROBE * window, end)
        if moved == self.seen:
            return None  # the decode holds a queue but serves nobody: stuck
        self.seen = moved
        return min(heard + window, end)
