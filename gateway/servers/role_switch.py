"""Switch a server between prefill and decode at runtime (SGLang's POST /pd_role_switch).

SGLang 0.5.23 flips an idle instance started with `--enable-pd-role-switch` without
reloading weights, and leaves the rest to its caller: drain ingress, serialize the switches
(managers/tokenizer_control_mixin.py `pd_role_switch`). The gateway's procedure, one switch
at a time (switch_lock.py):

1. refuse at once (409) when another switch runs, or when the server is the last serving
   one of its role for its model: a role is never left empty;
2. drain: the server leaves new-request routing (`draining`, told to the other workers);
3. wait until nothing of ours runs there (both legs, a prefill answer trailing its decode,
   attempts a rescue may restart: `Server.totals`, `Server.attempts`), up to the deadline;
4. `prepare_only` (SGLang checks every DP rank: idle, graph headroom, flags), then the
   switch; "instance is not idle" (a request of another replica, a KV transfer finishing) is
   asked again until the deadline; a switch to decode carries `decode_cuda_graph_memory_gb`
   and `decode_cuda_graph_bs` as a serving decode of its model reports them (its
   `/server_info` internal state), unless the admin gave them;
5. success: the server leaves the pool and is registered again in its new role from a fresh
   `/server_info` (role, bootstrap port, DP ranks), so its load, prefix entries and breaker
   start anew; the other workers do the same; a server an operator had drained stays
   drained there and in the other workers (it does not join the rotation unasked);
6. a refusal (SGLang's `safe_to_restore` true, the deadline, or the gateway shutting down:
   read while waiting and before each call to `/pd_role_switch`) puts it back as it was and
   says why; a switch that broke midway (`safe_to_restore` false, or no answer to the
   switch itself) leaves it drained and marked misconfigured ("restart required"): out of
   rotation until an operator removes and adds it again. The switch itself is waited for
   up to 300 s (a healthy one cut off would be taken out), or the rebalancer's shorter
   bound while every prefill is down (`answer_bound`, rebalance.py): in an outage a hung
   server is given up on and another decode tried, not waited 300 s for.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx

from gateway.errors import BadRequest, GatewayError, NotFound
from gateway.servers.pool import ROLES, Server, ServerPool
from gateway.servers.probe import fetch_server_info
from gateway.servers.switch_lock import SwitchBusy, SwitchLock

log = logging.getLogger("gateway.servers.role_switch")

SWITCH_TIMEOUT = 300.0  # at most: SGLang tears down, rebuilds, may capture decode graphs
MAX_DEADLINE = 3600.0
NOT_IDLE = "instance is not idle"
RETRY_EVERY = 0.1  # seconds between asks while SGLang says it is not idle
VERIFY_TRIES, VERIFY_EVERY = 10, 0.5  # re-reading /server_info after the flip
STOPPING = "the gateway is shutting down"


class SwitchRefused(GatewayError):
    """Nothing changed (or it was put back): 409 with the reason."""

    status = 409
    error_type = "invalid_request_error"


class SwitchBroken(GatewayError):
    """The server broke midway and was taken out: 502 with SGLang's reason."""

    status = 502
    error_type = "upstream_error"


class SwitchUnanswered(SwitchBroken):
    """The switch itself had no answer in its bound (or lost its connection): taken out as
    any broken switch; the rebalancer tries another decode at once in an outage."""


class _Refused(Exception):
    def __init__(self, message: str, outcome: str = "refused") -> None:
        super().__init__(message)
        self.outcome = outcome


class _Broken(Exception):
    def __init__(self, message: str, unanswered: bool = False) -> None:
        super().__init__(message)
        self.unanswered = unanswered


MAX_URL = 2048  # characters of a server URL in a switch's body


@dataclass(frozen=True, slots=True)
class SwitchAsk:
    """One admin request: which server, to what, how long its drain may take;
    `answer_within`: the switch's own answer bound (the rebalancer's, in an outage)."""

    url: str
    new_role: str
    deadline: float = 60.0
    graph_memory_gb: float | None = None
    graph_bs: tuple[int, ...] | None = None
    answer_within: float | None = None

    @classmethod
    def parse(cls, body: dict) -> SwitchAsk:
        """Validate the JSON body (400 naming the field)."""
        url, role = body.get("url"), body.get("role")
        if not isinstance(url, str) or len(url) > MAX_URL or not url.isprintable():
            # (logged before it is looked up: a newline or an escape would forge log lines)
            raise BadRequest("'url' must be a server URL")
        if role not in ROLES:
            raise BadRequest("'role' must be 'prefill' or 'decode' (the role to switch to)")
        deadline = body.get("deadline", 60)
        if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) \
                or not 0 <= deadline <= MAX_DEADLINE:
            raise BadRequest(f"'deadline' must be a number of seconds in 0..{MAX_DEADLINE:g}")
        gb = body.get("decode_cuda_graph_memory_gb")
        if gb is not None and (isinstance(gb, bool) or not isinstance(gb, (int, float))
                               or gb < 0):
            raise BadRequest("'decode_cuda_graph_memory_gb' must be a number >= 0")
        bs = body.get("decode_cuda_graph_bs")
        if bs is not None and not (isinstance(bs, list) and bs and all(
                isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in bs)):
            raise BadRequest("'decode_cuda_graph_bs' must be a list of batch sizes")
        return cls(url.rstrip("/"), role, float(deadline), gb, tuple(bs) if bs else None)


def _running() -> bool:
    """The default `SwitchParts.shutting_down`: a switcher built without one never stops."""
    return False


@dataclass(frozen=True, slots=True)
class SwitchParts:
    """The gateway's own parts the procedure uses (register/unregister are the runtime's,
    which also start and stop health checks; `tell` reaches the other workers)."""

    pool: ServerPool
    client: httpx.AsyncClient
    register: Callable[..., Awaitable[Server]]
    unregister: Callable[[str], Server | None]
    tell: Callable[..., None]
    probe_timeout: float
    lock: SwitchLock
    refuse_all: str | None = None  # why this gateway cannot switch at all (None: it can)
    shutting_down: Callable[[], bool] = _running  # true once SIGTERM came (RuntimeState)


class RoleSwitcher:
    """Runs the procedure; one instance per worker process."""

    def __init__(self, parts: SwitchParts) -> None:
        self.parts = parts

    async def switch(self, ask: SwitchAsk) -> dict[str, Any]:
        """Switch or raise SwitchRefused / SwitchBroken / NotFound; the answer's body."""
        p = self.parts
        if p.refuse_all is not None:
            raise SwitchRefused(p.refuse_all, code="role_switch_unavailable")
        server = p.pool.get(ask.url)
        if server is None:
            raise NotFound(f"no server {ask.url!r}")
        if server.role == ask.new_role:
            raise SwitchRefused(f"{ask.url} is already a {ask.new_role} server",
                                code="already_in_role")
        try:
            with p.lock.hold(ask.url, f"{ask.url} -> {ask.new_role}"):
                return await self._locked(server, ask)
        except SwitchBusy as exc:
            raise SwitchRefused(str(exc), code="role_switch_in_progress") from None

    async def _locked(self, server: Server, ask: SwitchAsk) -> dict[str, Any]:
        p, old = self.parts, server.role
        try:
            self._not_last(server)
            await self._peer_answers(server)
        except _Refused as exc:
            raise SwitchRefused(str(exc), code="role_empty") from None
        was_draining = server.draining
        self._drain(server, True)
        started = time.monotonic()
        deadline = started + ask.deadline
        asked = False  # the switch itself was sent: from then on its state may have changed
        try:
            await self._wait_idle(server, deadline, ask.deadline)
            body = await self._body(server, ask)
            self._not_last(server)  # a peer may have died while this one drained
            await self._call(server, {**body, "prepare_only": True}, deadline,
                             p.probe_timeout)
            self._not_last(server)
            await self._peer_answers(server)
            asked = True
            await self._call(server, body, deadline, answer_bound(ask, p.probe_timeout))
        except _Refused as exc:
            self._drain(server, was_draining)
            code = "role_empty" if exc.outcome == "empty" else f"role_switch_{exc.outcome}"
            raise SwitchRefused(f"{server.url} stays a {old} server, as it was: {exc}",
                                code=code) from None
        except _Broken as exc:
            self._take_out(server, ask.new_role, str(exc))
            broken = SwitchUnanswered if exc.unanswered else SwitchBroken
            raise broken(f"{server.url} broke while switching to {ask.new_role} and is out "
                         f"of rotation until it is restarted and added again: {exc}",
                         code="role_switch_failed") from None
        except BaseException:  # cancelled (shutdown) or a bug: never left drained for nothing
            if asked:
                self._take_out(server, ask.new_role, "the switch was interrupted")
            else:
                self._drain(server, was_draining)
            raise
        fresh = await self._register_again(server, ask.new_role, was_draining)
        return {"switched": True, "old_role": old, "new_role": ask.new_role,
                "waited_s": round(time.monotonic() - started, 3), "server": fresh.snapshot()}

    def _not_last(self, server: Server) -> None:
        """Raise _Refused unless another server of its role and model is serving: asked at
        the start and again right before each call that changes the server (a peer that
        died during the drain would otherwise leave the role empty)."""
        if not any(s is not server and s.model == server.model and s.serving
                   for s in self.parts.pool.role(server.role)):
            raise _Refused(f"{server.url} is the last serving {server.role} server of its "
                           f"model: switching it would leave no {server.role} server",
                           outcome="empty")

    async def _peer_answers(self, server: Server) -> None:
        """Raise _Refused unless a serving peer of its role and model answers its `/health`
        now: `serving` is what the last health checks said, and a peer that hung since reads
        serving for seconds more (a switch 0.2 s after the other decode hung left the role
        to it: 1 request served in 15 s against 489 without the switch)."""
        peers = [s for s in self.parts.pool.role(server.role)
                 if s is not server and s.model == server.model and s.serving]

        async def answers(peer: Server) -> bool:
            try:
                response = await self.parts.client.get(peer.url + "/health",
                                                       timeout=self.parts.probe_timeout)
            except httpx.HTTPError:
                return False
            return response.status_code == 200

        if not any(await asyncio.gather(*map(answers, peers))):
            raise _Refused(f"no other {server.role} server of its model answered its health "
                           f"check now: switching {server.url} would leave none that serves",
                           outcome="empty")

    def _not_stopping(self) -> None:
        """Raise _Refused once the gateway is stopping (SIGTERM): a switch that went on
        flipped the server during the shutdown (200 1.1 s after the signal, the restarted
        gateway's command line naming it in its old role), and one the grace cuts off
        leaves the server's state unknown."""
        if self.parts.shutting_down():
            raise _Refused(STOPPING)

    def _drain(self, server: Server, draining: bool) -> None:
        server.draining = draining
        self.parts.tell("drain" if draining else "undrain", server.url)

    async def _wait_idle(self, server: Server, deadline: float, allowed: float) -> None:
        """Until no request of this gateway runs there (every worker's counts)."""
        while server.totals()[0] > 0 or server.attempts:
            self._not_stopping()  # no use holding the shutdown until the drain ends
            if time.monotonic() >= deadline:
                raise _Refused(f"{server.totals()[0]} requests still in flight after the "
                               f"{allowed:g}s deadline", outcome="busy")
            await asyncio.sleep(0.05)

    async def _body(self, server: Server, ask: SwitchAsk) -> dict[str, Any]:
        """PdRoleSwitchReqInput: to decode, the graph figures of a matching decode peer."""
        body: dict[str, Any] = {"new_role": ask.new_role}
        if ask.new_role != "decode":
            return body
        gb, bs = ask.graph_memory_gb, list(ask.graph_bs) if ask.graph_bs else None
        if gb is None or bs is None:
            peer_gb, peer_bs = await self._peer_graphs(server)
            gb = peer_gb if gb is None else gb
            bs = peer_bs if bs is None else bs
        if gb is not None:
            body["decode_cuda_graph_memory_gb"] = gb
        if bs:
            body["decode_cuda_graph_bs"] = bs
        return body

    async def _peer_graphs(self, server: Server) -> tuple[float | None, list[int] | None]:
        """What a serving decode of the same model captured (InternalStateReader's
        decode_cuda_graph_memory_gb and decode_cuda_graph_bs); (None, None) if none says."""
        for peer in self.parts.pool.role("decode"):
            if peer.model != server.model or not peer.serving:
                continue
            try:
                info = await fetch_server_info(self.parts.client, peer.url,
                                               self.parts.probe_timeout)
            except ConnectionError:
                continue
            states = info.get("internal_states")
            state = states[0] if isinstance(states, list) and states else {}
            gb = state.get("decode_cuda_graph_memory_gb") if isinstance(state, dict) else None
            if isinstance(gb, (int, float)) and not isinstance(gb, bool):
                bs = state.get("decode_cuda_graph_bs")
                return float(gb), [b for b in bs if isinstance(b, int)] if isinstance(
                    bs, list) else None
        return None, None

    async def _call(self, server: Server, body: dict, deadline: float, within: float) -> None:
        """POST /pd_role_switch until it says yes, or raise _Refused (safe) / _Broken;
        each ask answered `within` seconds."""
        prepare = bool(body.get("prepare_only"))
        what = "prepare_only" if prepare else "the switch"
        while True:
            self._not_stopping()  # before each ask: nothing is sent once SIGTERM came
            try:
                response = await self.parts.client.post(
                    server.url + "/pd_role_switch", json=body, timeout=within)
            except httpx.HTTPError as exc:
                why = f"no answer to {what} within {within:g}s: {type(exc).__name__}"
                if prepare:
                    raise _Refused(why) from None
                raise _Broken(why + " (its state is unknown)", unanswered=True) from None
            answer = _json(response)
            if response.status_code == 200 and answer.get("success") is True:
                return
            message = str(answer.get("message") or f"HTTP {response.status_code}")[:500]
            if response.status_code in (404, 405):
                raise _Refused(f"it has no /pd_role_switch (SGLang 0.5.23 or later needed): "
                               f"{message}")
            safe = answer.get("safe_to_restore") is True or (prepare and "success" not in answer)
            if not safe:
                raise _Broken(f"SGLang answered {what} with: {message}")
            if NOT_IDLE in message and time.monotonic() + RETRY_EVERY < deadline:
                await asyncio.sleep(RETRY_EVERY)
                continue
            raise _Refused(f"SGLang refused {what}: {message}",
                           outcome="busy" if NOT_IDLE in message else "refused")

    def _take_out(self, server: Server, new_role: str, why: str) -> None:
        """Out of rotation here and in every other worker (and any started later), until an
        operator removes and adds it again."""
        reason = (f"role switch to {new_role} failed: {why[:300]}; restart required, then "
                  "remove and add it again")
        take_out(server, reason)
        self.parts.tell("take_out", server.url, why=reason)

    async def _register_again(self, server: Server, role: str, draining: bool) -> Server:
        """Out of the pool and back in as `role`, from a fresh /server_info; `draining`
        (an operator's drain from before the switch) is kept, here and in the other workers,
        which apply the `drain` after the `add`."""
        p = self.parts
        p.unregister(server.url)  # with its pairs and deadlines: they were another role's
        p.tell("remove", server.url)
        for attempt in range(VERIFY_TRIES):  # its event loop restarts in the new role first
            try:
                fresh = await p.register(server.url, role, None, require_probe=True,
                                         model=server.model)
                break
            except GatewayError as exc:  # not (yet) answering as its new role
                if attempt + 1 == VERIFY_TRIES:
                    raise SwitchBroken(
                        f"{server.url} switched to {role} but did not answer as one "
                        f"({exc.detail}); it is out of the pool: add it again when it does",
                        code="role_switch_unverified") from None
                await asyncio.sleep(VERIFY_EVERY)
        p.tell("add", server.url, role=role, bootstrap_port=None,  # (learned: each worker's
               model=server.model)  # own probe reads it, and reads it again after a restart)
        if draining:  # registered afresh, it would serve again (before: 23 requests in 4 s)
            self._drain(fresh, True)
        return fresh


def answer_bound(ask: SwitchAsk, floor: float) -> float:
    """Seconds the switch itself may take to answer: SWITCH_TIMEOUT, or the ask's
    `answer_within` (never under `floor`, what `prepare_only` is given). Not the drain's
    `deadline`: the switch is SGLang's own work (teardown, rebuild, graph capture), and one
    cut off while healthy leaves its server taken out (docs/ROLE_SWITCH.md, decision)."""
    if ask.answer_within is None:
        return SWITCH_TIMEOUT
    return min(SWITCH_TIMEOUT, max(ask.answer_within, floor))


def take_out(server: Server, reason: str) -> None:
    """Mark `server` broken: drained, unhealthy, misconfigured (`Server.serving` false)."""
    server.healthy = False
    server.draining = True
    server.misconfigured = reason


def _json(response: httpx.Response) -> dict:
    try:
        data = response.json()
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}
