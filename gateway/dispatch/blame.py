"""Which server of a failed pair to blame: the one that shows no sign of life.

A failed attempt names the leg that reported its failure, and that is often not the culprit:
a decode answers 500 "transfer failed" when its prefill never sent the KV, a prefill answers
"bootstrap failed" when its decode never came for it, and a hang leaves both legs waiting.
Avoiding both servers of every failed pair (and suspecting both of a hang) sends retries from
the one sound prefill to a hung one under compound faults, five seconds each (soak seed 22:
a 31.6 s answer while every server but one prefill had a fault).

The evidence is the servers' traffic: a server that completed a request (another one, or
this attempt's own leg) within the last `RECENT` seconds is alive. When exactly one server of
the pair is alive, the other one is blamed alone. When both are, the leg that reported a
failure of its own (a broken connection, a cut or malformed answer, its deadline passed: no
error status it answered, which may be its partner's doing) is blamed alone: a truncated
answer from a decode that serves most requests keeps the sound prefill in play rather than
trade it for one that serves nothing. Otherwise the pair is (which one failed is unknown).
A rescue names its server: that one alone.
`RECENT` is shorter than the shortest hang deadline (5 s, gateway/health/deadlines.py), so a
server that hung at the start of a wait has no success left inside the window at its end.
"""

from __future__ import annotations

import time

from gateway.servers.pool import Server

RECENT = 3.0  # seconds: a success this recent means the server serves requests now


def culprits(prefill: Server, decode: Server, leg: str | None = None, own: bool = False,
             rescued: bool = False) -> tuple[Server, ...]:
    """The servers of a failed pair to blame; `leg`: the leg that reported the failure
    (prefill, decode, both), `own`: a failure of that leg's own (no error status answered),
    `rescued`: a rescue stopped the attempt for that leg's server."""
    named = (prefill,) if leg == "prefill" else (decode,) if leg == "decode" else None
    if rescued and named is not None:
        return named
    since = time.monotonic() - RECENT
    prefill_alive = prefill.last_success > since
    decode_alive = decode.last_success > since
    if prefill_alive != decode_alive:
        return (decode,) if prefill_alive else (prefill,)
    if prefill_alive and own and named is not None:
        return named
    return (prefill, decode)
