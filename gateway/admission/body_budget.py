"""The in-flight body budget: the request bodies one serving process holds at once are bounded.

`--max-body-bytes` bounds one body; this bounds their sum (`--max-inflight-body-bytes`), so
concurrent large bodies cannot grow the gateway's memory without limit: a request whose body
would take the sum over the budget is refused with 503 and `Retry-After` before its body is
read when its declared `Content-Length` does not fit, else as soon as its chunks cross it. The
gateway holds a few times a body while it serves it (parsed, encoded once for both legs:
docs/BENCHMARKS.md, "Memory under large bodies"), so the budget bounds that memory too.

A request takes its bytes as its body arrives and gives them all back when it ends, however
it ends (answered, refused, failed, client gone): the endpoint's `finally` calls `release`.
The budget is never below one largest body, so a lone request of `--max-body-bytes` always fits.
"""

from __future__ import annotations

from starlette.types import Message, Receive, Scope

from gateway.errors import ServiceUnavailable

RETRY_AFTER = "1"  # seconds: large bodies in flight end within a few


class BodyBudget:
    """Bytes of request bodies in flight, at most `limit` (one process's count)."""

    __slots__ = ("limit", "used", "refused")

    def __init__(self, limit: int, max_body: int = 0) -> None:
        self.limit = max(limit, max_body)
        self.used = 0
        self.refused = 0  # requests refused for the budget

    def lease(self, scope: Scope, receive: Receive) -> BodyLease:
        """A request's share, charged as its body is received through `lease.receive`."""
        return BodyLease(self, scope, receive)

    def take(self, size: int) -> None:
        """Reserve `size` more bytes, or raise 503 with Retry-After if they do not fit."""
        self.check(size)
        self.used += size

    def check(self, size: int) -> None:
        """Raise 503 with Retry-After if `size` more bytes do not fit now."""
        if self.used + size > self.limit:
            self.refused += 1
            raise ServiceUnavailable(
                f"the gateway holds {self.used} bytes of request bodies in flight and this "
                f"body would take it over its limit of {self.limit} "
                "(--max-inflight-body-bytes); retry shortly",
                code="body_budget_exhausted", headers={"Retry-After": RETRY_AFTER})


class BodyLease:
    """One request's bytes of the budget: taken by `receive`, all given back by `release`."""

    __slots__ = ("budget", "scope", "_receive", "held")

    def __init__(self, budget: BodyBudget, scope: Scope, receive: Receive) -> None:
        self.budget = budget
        self.scope = scope
        self._receive = receive
        self.held = 0  # bytes taken from the budget: the body received so far

    async def receive(self) -> Message:
        """The ASGI receive, charging each chunk of the body as it arrives; a declared
        Content-Length that does not fit now is refused before anything is read. (Not
        reserved up front: a client that declares a large body and sends nothing would hold
        the budget from every other request while it held no memory.)"""
        budget = self.budget
        if self.held == 0:
            declared = _content_length(self.scope)
            if declared:
                budget.check(declared)
        message = await self._receive()
        chunk = message.get("body")
        if chunk:
            budget.take(len(chunk))
            self.held += len(chunk)
        return message

    def release(self) -> None:
        """Give every byte back (idempotent)."""
        self.budget.used -= self.held
        self.held = 0


def _content_length(scope: Scope) -> int:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return max(0, int(value))
            except ValueError:
                return 0
    return 0
