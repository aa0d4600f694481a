"""The `/v1/loads` figures of one server or DP rank, and what this gateway knows that they
do not: its own requests that the snapshot still counts though they are done.

A snapshot may count a request of ours that is done if the server held it when it took the
poll, at some moment between the poll's sending and its answer's arrival. Three cases, each
settled (taken off the snapshot's figures; the load score subtracts `settled` and
`settled_tokens`, gateway/scheduling/load.py):

* dispatched before the snapshot's answer arrived, done since (`settle`, on the current
  snapshot): sent before the poll, the server held it; sent while the poll was on its way,
  it may have (the poll waits for the scheduler's next step, where the request may already
  be), and taking a finished request off is the safe side: it is no load any more, and the
  score never drops below this gateway's own in-flight count;
* done while the next poll is on its way (`pending`, carried into its answer: `carry`);
* done as far as the gateway goes (its decode answered) while its prefill's own answer is
  still to come (the CPU rig's prefill answers after the decode; `trail`): the server may
  hold its KV until then, so every snapshot asked meanwhile counts it (`asked_trailing`).

Without them a conversation's next turn, sent as the previous one ends, found the previous
turn's server "busy" with that very turn, and the cache-aware policy moved it off its cache
(tests/e2e_sglang/test_dp.py, tests/unit/servers/test_load.py: in one CI run the turn had
been sent while a poll was on its way, and the answer counted it).
"""

from __future__ import annotations

from dataclasses import dataclass

SAMPLE_US = 250_000  # a poll's prefill busy time weighs at most this much (a quarter second)


@dataclass(slots=True)
class ServerLoad:
    """The latest `/v1/loads` figures of a server (summed over its DP ranks). Slots: the
    request path writes it as each leg ends (`settle`, `trail`)."""

    running: int = 0
    waiting: int = 0
    waiting_uncached_tokens: int = 0
    used_tokens: int = 0
    max_total_tokens: int = 0
    token_usage: float = 0.0
    max_running_requests: int = 0
    updated_at: float = 0.0  # when the poll was sent (the figures are not newer)
    answered_at: float = 0.0  # when its answer arrived (the figures are not older)
    # cumulative, SGLang's Scheduler._record_step_counters: tokens its prefill steps extended
    # and their busy time; successive snapshots give the server's measured prefill speed
    prefill_tokens: int = 0
    prefill_busy_us: int = 0
    prefill_speed: float = 0.0  # tokens/s, smoothed over snapshots; 0 until measured
    smoothed_tokens: float = 0.0  # per-snapshot prefilled tokens and busy microseconds,
    smoothed_busy_us: float = 0.0  # each smoothed: their ratio is `prefill_speed`
    # requests of this gateway process that were running when the snapshot was taken and
    # have finished since, and their prompt tokens: the snapshot still counts them
    settled: int = 0
    settled_tokens: int = 0
    # ours running when the next poll was sent (`asked_at`) that ended since (`carry`)
    asked_at: float = 0.0
    pending: int = 0
    pending_tokens: int = 0
    # ours done but for their prefill's answer (`trail`), now and when the poll was sent
    trailing: int = 0
    trailing_tokens: int = 0
    asked_trailing: int = 0
    asked_trailing_tokens: int = 0

    def settle(self, since: float, tokens: int) -> None:
        """A request of ours dispatched at `since` (time.monotonic()) has finished. The
        snapshot may count it as running and its KV as in use (SGLang's `token_usage` leaves
        out what its radix cache may evict, which the KV of a finished request becomes) if
        it was dispatched before the answer arrived; so may the answer of a poll now on its
        way (`asked_at` after this snapshot's)."""
        if since < max(self.answered_at, self.updated_at):
            self.settled += 1
            self.settled_tokens += tokens
        if self.asked_at > self.updated_at:
            self.pending += 1
            self.pending_tokens += tokens

    def trail(self, tokens: int, sign: int = 1) -> None:
        """A settled request of ours whose prefill has not answered yet (sign 1), or whose
        prefill leg has now ended (-1)."""
        count, held = self.trailing + sign, self.trailing_tokens + sign * tokens
        self.trailing = count if count > 0 else 0  # (ranks remade meanwhile: from 0)
        self.trailing_tokens = held if held > 0 else 0

    def ask(self, asked: float) -> None:
        """A poll goes out at `asked`: note what its answer will still count."""
        self.asked_at = asked
        self.pending = self.pending_tokens = 0  # a poll that got no answer settles nothing
        self.asked_trailing, self.asked_trailing_tokens = self.trailing, self.trailing_tokens

    def carry(self, before: ServerLoad) -> None:
        """This snapshot answers the poll `before` awaited: ours that ended meanwhile, and
        those that were trailing when it was sent, are settled in it."""
        self.settled = before.pending + before.asked_trailing
        self.settled_tokens = before.pending_tokens + before.asked_trailing_tokens
        self.trailing, self.trailing_tokens = before.trailing, before.trailing_tokens

    def follow(self, before: ServerLoad) -> None:
        """Carry the measured prefill speed over from the previous snapshot, updated by
        what the server prefilled in between (a restart's smaller counters teach nothing),
        and our requests that ended while this one was on its way (`carry`). The tokens and
        the busy time are smoothed apart and divided, not their ratio smoothed: a slow step
        then weighs by its time, as it does in the time a prompt waits (a mean of per-poll
        ratios read 1.5x SGLang's own counters on the CPU rig, tests/e2e_sglang/test_slo.py)."""
        self.carry(before)
        tokens = self.prefill_tokens - before.prefill_tokens
        busy = self.prefill_busy_us - before.prefill_busy_us
        smoothed, smoothed_us = before.smoothed_tokens, before.smoothed_busy_us
        if tokens > 0 and busy > 0:
            if busy > SAMPLE_US:  # the counters since the server started (a first poll, or
                tokens, busy = tokens * SAMPLE_US / busy, SAMPLE_US  # one after a gap): its
                # speed, weighed as one poll's, or its bulk would outweigh later polls
            if smoothed_us == 0.0:
                smoothed, smoothed_us = float(tokens), float(busy)
            else:
                smoothed = 0.7 * smoothed + 0.3 * tokens
                smoothed_us = 0.7 * smoothed_us + 0.3 * busy
        self.smoothed_tokens, self.smoothed_busy_us = smoothed, smoothed_us
        self.prefill_speed = smoothed * 1e6 / smoothed_us if smoothed_us else 0.0



def load_entry(entry: dict, now: float) -> ServerLoad:
    def number(name: str) -> int:
        value = entry.get(name)
        return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0

    usage = entry.get("token_usage")
    return ServerLoad(
        running=number("num_running_reqs"), waiting=number("num_waiting_reqs"),
        waiting_uncached_tokens=number("num_waiting_uncached_tokens"),
        used_tokens=number("num_used_tokens"), max_total_tokens=number("max_total_num_tokens"),
        token_usage=float(usage) if isinstance(usage, (int, float)) else 0.0,
        max_running_requests=number("max_running_requests"), updated_at=now,
        prefill_tokens=number("total_prefill_uncached_tokens"),
        prefill_busy_us=number("total_prefill_busy_us"))
