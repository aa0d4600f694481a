"""Aborting a request in flight on the servers that run it (for `POST /abort_request`).

For each attempt of the request now running, `{"rid": <upstream rid>}` goes to its prefill and
its decode server, so SGLang ends the generation the way it ends any aborted one (the client
gets SGLang's own answer with `finish_reason` `abort`). A client-chosen rid is forwarded only
when it is not a prefix of another request's rid in flight (SGLang's scheduler aborts by
prefix); otherwise, for a request not dispatched yet, and for an Anthropic Messages request
(SGLang's conversion to a chat drops the rid, and it answers `success` for a rid it does not
know: the abort did nothing and said it worked), the gateway stops the request itself
(`Interrupt`), which closes its upstream connections (SGLang aborts a request whose
connection closed), and the client gets a 400 "aborted" (a stream: an error event).
"""

from __future__ import annotations

import asyncio
import contextlib

import orjson

from gateway.dispatch.inflight import InFlight, Tracked
from gateway.errors import BadRequest
from gateway.request import MESSAGES


class Aborted(BadRequest):
    """The request was aborted by `/abort_request` before SGLang could end it itself."""

    error_type = "request_aborted"


class Aborts:
    def __init__(self, inflight: InFlight, control, timeout: float) -> None:
        self.inflight = inflight
        self.control = control  # Upstream for the best-effort POSTs
        self.timeout = timeout

    async def abort(self, tracked: Tracked) -> list[dict]:
        tracked.aborted = True
        attempts = list(tracked.attempts)
        forwardable = attempts and all(
            a.view.endpoint != MESSAGES and self.inflight.prefix_safe(rid, tracked)
            for a in attempts for rid in a.rid_list)
        if not forwardable:
            stopped = tracked.interrupt is not None and tracked.interrupt.fire(
                Aborted(f"request {tracked.request_id} was aborted"))
            return [{"action": "stopped by the gateway", "ok": bool(stopped)}]
        posts = [(server, rid) for attempt in attempts
                 for server in (attempt.prefill, attempt.decode) for rid in attempt.rid_list]
        return list(await asyncio.gather(*(self._post(w, rid) for w, rid in posts)))

    async def _post(self, server, rid: str) -> dict:
        result = {"url": server.url, "role": server.role, "rid": rid, "ok": False}
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.timeout):
                response = await self.control.post(server.url, "/abort_request",
                                                   orjson.dumps({"rid": rid}), "abort")
                await response.read()
                result["ok"] = response.status < 300
                result["status"] = response.status
        return result
