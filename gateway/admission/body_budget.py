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

from gateway.errors import ServiceUnavailable

RETRY_AFTER = "1"  # seconds: large bodies in flight end within a few


class BodyBudget:
    """Bytes of request bodies in flight, at most `limit` (one process's count)."""

    __slots__ = ("limit", "used", "refused")

    def __init__(self, limit: int, max_body: int = 0) -> None:
        self.limit = max(limit, max_body)
        self.used = 0
        self.refused = 0  # requests refused for the budget

    def lease(self) -> BodyLease:
        """A request's share, charged as the body reader receives its body."""
        return BodyLease(self)

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
    """One request's bytes of the budget: charged by the body reader as chunks arrive
    (`gateway/routes/asgi.read_body`), all given back by `release`."""

    __slots__ = ("budget", "held")

    def __init__(self, budget: BodyBudget) -> None:
        self.budget = budget
        self.held = 0  # bytes taken from the budget: the body received so far

    def declared(self, size: int) -> None:
        """A declared Content-Length that does not fit now is refused before anything is
        read. (Not reserved up front: a client that declares a large body and sends nothing
        would hold the budget from every other request while it held no memory.)"""
        if self.held == 0:
            self.budget.check(size)

    def take(self, size: int) -> None:
        """A chunk of the body arrived: its bytes are charged (503 if they do not fit)."""
        self.budget.take(size)
        self.held += size

    def release(self) -> None:
        """Give every byte back (idempotent)."""
        self.budget.used -= self.held
        self.held = 0
