"""Stopping attempts that wait on a server the gateway knows or suspects is bad.

A request must not wait for a server that cannot answer: when the health checks mark a server
down or its breaker opens, every attempt waiting on it is stopped (`stop_all`) and retried on
another pair at once. A hang is also suspected from the traffic itself (gateway/pd.py): an
attempt that made no progress within its learned deadline stops its cohort on the same pair
(`pair_cohort`) and makes both servers suspects (`suspect_if_hung`), which new requests avoid
while others can serve; a stream whose KV arrived but whose decode sent nothing marks that
decode hung (`decode_hung`). Each stop fires the attempt's `Interrupt` with a retryable error.
"""

from __future__ import annotations

import time

from gateway.attempt import Attempt
from gateway.errors import UpstreamError
from gateway.workers import Worker


def _stop(attempt: Attempt, error: UpstreamError) -> bool:
    return attempt.interrupt is not None and attempt.interrupt.fire(error)


def stop_all(worker: Worker, why: str, but: Attempt | None = None) -> int:
    """Stop every attempt waiting on `worker`; returns how many."""
    stopped = 0
    for attempt in list(worker.attempts):
        if attempt is not but and _stop(attempt, UpstreamError(
                why, leg=worker.role, worker_url=worker.url, retryable=True, status=502,
                reason="rescued")):
            stopped += 1
    return stopped


def suspect_if_hung(attempt: Attempt, now: float, first: float, seconds: float) -> None:
    """An attempt that failed without progress after waiting its learned deadline (or about as
    long: a prefill's bootstrap timeout, its decode never came) looks like a hang: both servers
    become suspects, and new requests avoid them for `seconds`."""
    if not attempt.progressed and now - attempt.started_at >= 0.9 * first:
        until = time.monotonic() + seconds
        attempt.prefill.suspect_until = attempt.decode.suspect_until = until


def decode_hung(attempt: Attempt, seconds: float) -> None:
    """A stream's prefill answered and its decode sent no first chunk within the decode's
    learned gap deadline: the decode, not the pair, is hung. It becomes a suspect and every
    attempt waiting on it now is stopped, to be retried elsewhere."""
    decode = attempt.decode
    decode.suspect_until = time.monotonic() + seconds
    stop_all(decode, f"decode server {decode.url} is suspected hung (a stream got no first "
             "token after its KV arrived)", but=attempt)


def pair_cohort(attempt: Attempt) -> None:
    """An attempt made no progress within its learned deadline: the attempts on the same pair
    that have waited about as long are stopped now too (they are in the same situation), rather
    than each waiting out its own deadline on a pair likely hung. Attempts of other pairs are
    left alone: which of the two servers hangs is unknown."""
    cutoff = attempt.started_at + 1.0
    decode = attempt.decode
    for other in list(attempt.prefill.attempts):
        if (other is not attempt and other.decode is decode and not other.progressed
                and other.started_at <= cutoff):
            _stop(other, UpstreamError(
                f"the pair of prefill {attempt.prefill.url} and decode {decode.url} is "
                "suspected hung (a request waiting as long timed out)", leg="both",
                worker_url=attempt.prefill.url, retryable=True, status=504, reason="rescued"))
