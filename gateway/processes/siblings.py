"""What one worker of `--workers N` does for the others, over the control channel.

* Admin changes (a server added, removed, drained, undrained) are applied by the worker that
  got the admin call and then by every other worker, so the workers keep one server set. An
  add first claims its URL of the hub (`claimed`), so that of two adds of one URL made at once
  through two workers only one registers it (gateway/processes/claims.py).
* `/abort_request` names a request that may run in another worker: the worker that got it
  asks the others, and each aborts the caller's own requests holding that id (an admin's:
  first `owners`, so that an id several callers hold aborts none; docs/SECURITY.md, Aborts).
* A Responses cancel first asks the others to write a turn's final save they hold pending
  (the store refused it; gateway/responses/service.py), so it does not win over a response
  its client got whole.

Without workers (`control` None) every call here does nothing.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from gateway.errors import GatewayError, ServiceUnavailable
from gateway.servers.role_switch import take_out

log = logging.getLogger("gateway.processes.siblings")
CLAIM_TIMEOUT = 3.0  # seconds an admin add waits for the hub's word on its URL


class Siblings:
    """Given the parts it changes or reads: the server pool with its register/unregister
    (the runtime's, which also start and stop health checks), the in-flight table, aborts."""

    def __init__(self, control, pool, register: Callable[..., Awaitable[object]],
                 unregister: Callable[[str], object], inflight, aborts) -> None:
        self.control = control
        self.pool, self.register, self.unregister = pool, register, unregister
        self.inflight, self.aborts = inflight, aborts
        self._tokens = itertools.count(1)  # tells this worker's claims apart
        if control is not None:
            control.on("admin", self._apply)
            control.on("abort", self._abort)

    def admin_change(self, op: str, url: str, **extra) -> None:
        """Tell the other workers what this one just did to its server set."""
        if self.control is not None:
            self.control.tell_all({"kind": "admin", "op": op, "url": url, **extra})

    @contextlib.asynccontextmanager
    async def claimed(self, url: str) -> AsyncIterator[None]:
        """Hold `url` for an admin add while the body registers it and tells the others:
        409 if another add of it (in any worker) holds it or added it; 503 if the hub does
        not answer within CLAIM_TIMEOUT. Given back unless the body returns."""
        if self.control is None:
            yield
            return
        msg = {"kind": "claim", "url": url, "token": next(self._tokens)}
        try:
            answer = await self.control.ask_hub(msg, CLAIM_TIMEOUT)
        except TimeoutError:
            self.control.tell_hub({**msg, "kind": "release"})  # if it came late after all
            raise ServiceUnavailable(
                f"{url} was not added: the supervisor, which decides between adds of one "
                f"URL through several workers, did not answer within {CLAIM_TIMEOUT:g}s; "
                "try again",
                headers={"retry-after": "1"}) from None
        if not isinstance(answer, dict) or not answer.get("claimed"):
            raise GatewayError(f"{url} is already registered", status=409)
        added = False
        try:
            yield
            added = True
        finally:
            if not added:  # its registration failed: the URL is free again
                self.control.tell_hub({**msg, "kind": "release"})

    async def _apply(self, msg: dict) -> None:
        op, url = msg.get("op"), msg.get("url")
        server = self.pool.get(url)
        if op == "add" and server is None:
            try:
                await self.register(url, msg["role"], msg.get("bootstrap_port"),
                                    model=msg.get("model"))
            except Exception as exc:  # noqa: BLE001 - it was accepted by a sibling
                log.warning("could not add %s as the other workers did: %s", url, exc)
        elif op == "remove" and server is not None:
            self.unregister(url)
        elif op in ("drain", "undrain") and server is not None:
            server.draining = op == "drain"
        elif op == "take_out" and server is not None:  # a role switch broke it midway
            take_out(server, str(msg.get("why") or "a role switch failed"))

    async def abort(self, rid: str, owner: str, admin: bool) -> dict | None:
        """Abort `rid` in the other workers: every request of `owner` holding it (an admin
        with no owner: the holders, if they are all one owner's); their answers merged, or
        None when none aborted anything."""
        if self.control is None:
            return None
        found = [a for a in await self.control.ask({"kind": "abort", "rid": rid,
                                                    "owner": owner, "admin": admin})
                 if isinstance(a, dict) and a.get("found")]
        if not found:
            return None
        ids = [i for a in found for i in a.get("request_ids") or [a["request_id"]]]
        return {"found": True, "request_id": ids[0], "request_ids": ids,
                "results": [r for a in found for r in a["results"]]}

    async def owners(self, rid: str, owner: str | None) -> set[str]:
        """Whose requests in the other workers hold `rid` (of `owner` only, if given)."""
        if self.control is None:
            return set()
        answers = await self.control.ask({"kind": "abort", "rid": rid, "owner": owner or "",
                                          "admin": True, "count": True})
        return {o for a in answers if isinstance(a, dict) for o in a.get("owners", ())}

    def on_settle(self, settle: Callable[[str, str], Awaitable[bool]]) -> None:
        """`settle(rid, tenant)` answers the others' `settle` (the process's Responses)."""
        if self.control is not None:
            async def answer(msg: dict) -> dict:
                try:
                    return {"settled": await settle(msg["rid"], msg["tenant"])}
                except ServiceUnavailable:  # pending here, the store refused it again
                    return {"settled": False, "down": True}
            self.control.on("settle", answer)

    async def settle(self, rid: str, tenant: str) -> bool:
        """True when another worker held `rid`'s final save pending and wrote it now;
        ServiceUnavailable when it held it but the store refused it."""
        if self.control is None:
            return False
        answers = await self.control.ask({"kind": "settle", "rid": rid, "tenant": tenant})
        if any(isinstance(a, dict) and a.get("down") for a in answers):
            raise ServiceUnavailable("the response store is unavailable: a final save "
                                     "pending in another worker was refused",
                                     headers={"retry-after": "2"})
        return any(isinstance(a, dict) and a.get("settled") for a in answers)

    async def _abort(self, msg: dict) -> dict:
        """A caller's abort reaches its own requests only; an admin's without an owner only
        when the holders are one owner's (several: none, as at the admin's own worker)."""
        owner = msg.get("owner") or None
        if owner is None and not msg.get("admin"):
            return {"found": False}
        held = self.inflight.holders(msg["rid"], owner)
        owners = {t.owner for t in held}
        if msg.get("count"):
            return {"found": bool(held), "owners": sorted(owners)}
        if not held or len(owners) > 1:
            return {"found": False, "owners": sorted(owners)}
        results = [r for t in held for r in await self.aborts.abort(t)]
        return {"found": True, "request_id": held[0].request_id,
                "request_ids": [t.request_id for t in held], "results": results}
