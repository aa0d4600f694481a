"""Stopping attempts that wait on a server the gateway knows or suspects is bad.

A request must not wait for a server that cannot answer: when the health checks mark a server
down or its breaker opens, the attempts waiting on it are stopped (`rescue`, by `stop_all`)
and retried on another pair at once, provided its role has another usable server for the
retry; the only server of its role keeps its attempts, each bounded by its own deadlines. A
hang is also suspected from the traffic itself (gateway/dispatch/pd.py): an attempt that made no
progress within its learned deadline stops its cohort on the same pair (`pair_cohort`) and
makes both servers suspects (`suspect_if_hung`), which new requests avoid while others can
serve; a stream whose KV arrived but whose decode sent nothing marks that decode hung
(`decode_hung`, which stops its other attempts whatever else is usable: its caller does not
see the pool). Each stop fires the attempt's `Interrupt` with a retryable error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from gateway.dispatch.attempt import Attempt
from gateway.dispatch.blame import culprits
from gateway.errors import UpstreamError
from gateway.servers.pool import Server

log = logging.getLogger("gateway.dispatch.rescue")
RESCUED = "rescued"  # UpstreamError.reason of an attempt stopped here


def _stop(attempt: Attempt, error: UpstreamError) -> bool:
    return attempt.interrupt is not None and attempt.interrupt.fire(error)


def stop_all(server: Server, why: str, but: Attempt | None = None) -> int:
    """Stop every attempt waiting on `server`; returns how many."""
    stopped = 0
    for attempt in list(server.attempts):
        if attempt is not but and _stop(attempt, UpstreamError(
                why, leg=server.role, server_url=server.url, retryable=True, status=502,
                reason=RESCUED)):
            stopped += 1
    return stopped


def rescue(server: Server, why: str, peers: Iterable[Server] | None) -> int:
    """`server` was marked down or opened its breaker: stop the attempts waiting on it, so
    they are retried at once, only when a retry has somewhere to go; returns how many stopped.

    Somewhere to go: another server of the same role and model in `peers` (the pool's servers
    of that role) that is `usable`, as the scheduler's first choice is. Without one, a retry
    finds no usable server and answers 503, or (panic routing) goes back to this very server
    with new rooms, after aborting the work it had done; while the server may just be slow
    (seen with real SGLang: the only decode stalled 10 s, /health included, was marked down,
    and came back a second after its attempts had been stopped and answered 503). So its
    attempts keep waiting, each bounded by its own deadlines (first progress, response
    timeout, the request's total timeout; gateway/dispatch/pd.py): a server that comes back finishes
    them, a dead one fails them by its connection errors or those deadlines, and a failure
    then is retried as any other. `peers` None (not known) stops them all, as before.
    Each rescue with attempts waiting logs its decision once (info)."""
    waiting = len(server.attempts)
    if not elsewhere(server, peers):
        if waiting:
            log.info("%s: %d attempt(s) keep waiting on it (no other usable %s server for "
                     "a retry)", why, waiting, server.role)
        return 0
    stopped = stop_all(server, why)
    if waiting:
        log.info("%s: %d attempt(s) stopped, to be retried elsewhere", why, stopped)
    return stopped


def suspect_if_hung(attempt: Attempt, now: float, first: float, seconds: float) -> None:
    """An attempt that failed without progress after waiting its learned deadline (or about as
    long: a prefill's bootstrap timeout, its decode never came) looks like a hang: its servers
    become suspects, and new requests avoid them for `seconds`. Not one that served other
    requests meanwhile while its partner did not (`blame.culprits`): a sound prefill made a
    suspect by a frozen decode left new requests only a hung prefill."""
    if not attempt.progressed and now - attempt.started_at >= 0.9 * first:
        until = time.monotonic() + seconds
        for server in culprits(attempt.prefill, attempt.decode):
            server.suspect_until = until


def elsewhere(server: Server, peers: Iterable[Server] | None) -> bool:
    """Whether the retry of an attempt stopped on `server` has somewhere to go (`rescue`):
    another server of its role and model that is usable, or whose health checks pass while
    its breaker is still open from earlier failures and which is no suspect itself (the
    scheduler sends a retry there when the usable ones are suspects: a recovering server is
    a better bet than a hung one). `peers` None: not known, assumed so."""
    if peers is None:
        return True
    now = time.monotonic()
    return any(other is not server and other.role == server.role
               and other.model == server.model
               and (other.usable or (other.serving and other.suspect_until <= now))
               for other in peers)


def decode_hung(attempt: Attempt, seconds: float,
                peers: Iterable[Server] | None = None) -> None:
    """A stream's prefill answered and its decode sent no first chunk within the decode's
    learned gap deadline: the decode, not the pair, is hung. It becomes a suspect, and the
    other attempts waiting on it now are stopped to be retried elsewhere, when there is an
    elsewhere (`elsewhere`, as for `rescue`: a lone decode's keep their own deadlines)."""
    decode = attempt.decode
    decode.suspect_until = time.monotonic() + seconds
    if elsewhere(decode, peers):
        stop_all(decode, f"decode server {decode.url} is suspected hung (a stream got no "
                 "first token after its KV arrived)", but=attempt)


def pair_cohort(attempt: Attempt) -> None:
    """An attempt made no progress within its learned deadline: the attempts on the same pair
    that have waited about as long are stopped now too (they are in the same situation), rather
    than each waiting out its own deadline on a pair likely hung. Attempts of other pairs are
    left alone: which of the two servers hangs is unknown, and so are those still queued
    behind work their prefill is doing (dispatch/first_progress.py)."""
    cutoff = attempt.started_at + 1.0
    decode = attempt.decode
    for other in list(attempt.prefill.attempts):
        queued = getattr(other.deadline, "queued", None)
        if (other is not attempt and other.decode is decode and not other.progressed
                and other.started_at <= cutoff and not (queued is not None and queued())):
            _stop(other, UpstreamError(
                f"the pair of prefill {attempt.prefill.url} and decode {decode.url} is "
                "suspected hung (a request waiting as long timed out)", leg="both",
                server_url=attempt.prefill.url, retryable=True, status=504, reason=RESCUED))
