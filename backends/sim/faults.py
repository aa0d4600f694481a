"""Injected faults, applied when a generation request arrives.

--crash-after N   the (N+1)-th generation request kills the process (os._exit)
--error-rate P    a fraction P of requests is answered 500 at once; the
                  request never reaches the scheduler, so no room is touched
--hang            requests are read and never answered (until the client leaves)
fail_bootstrap_port (POST /sim/faults only)  requests whose bootstrap_port is this one get a
                  500 as SGLang answers a broken transfer session between one prefill and
                  one decode (SGLang issue #13054): a pair fault, the server is fine otherwise
--first-token-delay S, --slow-start S, --health-fail act in flows.py/state.py
truncate_rate, stall_after (POST /sim/faults only) break a 200 answer mid-body: cuts.py
withhold_kv (POST /sim/faults only) a prefill that never sends its KV: flows.py
"""

from __future__ import annotations

import os
import sys

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from backends.sim.state import SimState

CRASH_EXIT_CODE = 17


class _Hang:
    """An answer that never comes; counts the request cancelled when the client leaves."""

    def __init__(self, state: SimState, endpoint: str) -> None:
        self.state, self.endpoint = state, endpoint

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        finally:
            self.state.stats.record(self.endpoint, "", None, "cancelled", "hang fault")


async def before_generation(state: SimState, request: Request, endpoint: str) -> ASGIApp | None:
    """Return an early answer if a fault applies, else None."""
    f = state.config.faults
    state.generation_requests += 1
    if f.crash_after and state.generation_requests > f.crash_after:
        sys.stderr.write(f"sim: crashing on request {state.generation_requests} (--crash-after)\n")
        sys.stderr.flush()
        os._exit(CRASH_EXIT_CODE)
    if f.error_rate > 0 and state.rng.random() < f.error_rate:
        await request.body()
        state.stats.record(endpoint, "", None, "failed", "error-rate fault")
        state.stats.faulted("error_rate")
        message = "Simulated internal server error (--error-rate)"
        return JSONResponse({"object": "error", "message": message, "type": "500", "param": None,
                             "code": 500}, status_code=500)
    if f.hang:
        await request.body()
        state.stats.faulted("hang")
        return _Hang(state, endpoint)
    if f.fail_bootstrap_port:
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError:
            body = None
        port = body.get("bootstrap_port") if isinstance(body, dict) else None
        if f.fail_bootstrap_port in (port if isinstance(port, list) else [port]):
            state.stats.record(endpoint, "", None, "failed", "pair fault")
            state.stats.faulted("pair")
            message = (f"Decode transfer failed for request rank=0 with exception KVTransferError: "
                       f"transfer session to {body.get('bootstrap_host')}:{f.fail_bootstrap_port} "
                       "is broken (pair fault)")
            return JSONResponse({"object": "error", "message": message, "type": "500",
                                 "param": None, "code": 500}, status_code=500)
    return None
