"""Role switches against the gateway's shutdown and an operator's drain (no sockets): a
switch stops once SIGTERM came, keeps a drained server drained, and a switch the shutdown
cuts off answers a JSON 503 and stays cancelled. The fakes are test_role_switch.py's."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from types import SimpleNamespace

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Route
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from gateway.admission.auth import ADMIN
from gateway.app import guarded
from gateway.observability.usage import Usage
from gateway.processes.control_channel import Hub
from gateway.processes.siblings import Siblings
from gateway.routes.errors import HANDLERS
from gateway.routes.role_switch import PATH, RoleSwitchParts, parts_of, switch_role
from gateway.servers.pool import Server
from gateway.servers.role_switch import RoleSwitcher, SwitchAsk, SwitchRefused
from tests.unit.routes.test_uvicorn_send import UvicornTransport
from tests.unit.servers.test_role_switch import OK, P0, P1, fleet, switcher

READY = {**OK, "message": "ready"}


async def until(condition: Callable[[], bool], within: float = 5.0) -> None:
    """Wait for `condition`, failing after `within` seconds."""
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "the condition was not met in time"
        await asyncio.sleep(0.01)


def stoppable(sw: RoleSwitcher) -> list[bool]:
    """The switcher reads its gateway's shutting-down flag from the returned list."""
    stopping = [False]
    sw.parts = dataclasses.replace(sw.parts, shutting_down=lambda: stopping[0])
    return stopping


def put_back(server: Server) -> bool:
    return (server.role, server.draining, server.misconfigured) == ("prefill", False, None)


# A: a SIGTERM stops a switch that has not flipped yet

def test_a_sigterm_during_the_drain_refuses_the_switch_before_anything_is_asked():
    """SIGTERM while the server drains, then its last request ends: before, the switch went
    on, flipped it and answered 200 during the shutdown; now it is refused and put back."""
    pool = fleet()
    busy = pool.get(P1)
    busy.in_flight = 1

    async def main() -> tuple[BaseException | None, list[dict]]:
        sw, asked = switcher(pool, lambda body: httpx.Response(200, json=OK))
        stopping = stoppable(sw)
        task = asyncio.ensure_future(sw.switch(SwitchAsk(P1, "decode", deadline=30)))
        await until(lambda: busy.draining)
        stopping[0] = True  # cli.py GatewayServer.shutdown
        busy.in_flight = 0
        await asyncio.wait([task], timeout=5)
        assert task.done()
        return task.exception(), asked
    refused, asked = asyncio.run(main())
    assert isinstance(refused, SwitchRefused), refused
    assert refused.code == "role_switch_refused" and "shutting down" in str(refused)
    assert asked == [] and put_back(busy)


def test_a_sigterm_after_prepare_only_stops_the_switch_itself():
    pool = fleet()
    stopping = [False]

    def answer(body: dict) -> httpx.Response:
        stopping[0] = True  # SIGTERM while SGLang checks the server
        return httpx.Response(200, json=READY)
    sw, asked = switcher(pool, answer)
    sw.parts = dataclasses.replace(sw.parts, shutting_down=lambda: stopping[0])
    with pytest.raises(SwitchRefused, match="shutting down") as caught:
        asyncio.run(sw.switch(SwitchAsk(P1, "decode", deadline=5)))
    assert caught.value.code == "role_switch_refused"
    assert [b.get("prepare_only", False) for b in asked] == [True]  # never the switch
    assert put_back(pool.get(P1)) and sw.parts.lock.holder is None


def test_the_route_gives_the_switcher_the_gateways_shutting_down_flag():
    gw = SimpleNamespace(
        config=SimpleNamespace(probe_timeout=1.0, prefill_selector=None, decode_selector=None),
        shared=None, pool=fleet(), client=None, register=None, unregister=None,
        siblings=SimpleNamespace(admin_change=None), metrics=SimpleNamespace(role_switches=None),
        state=SimpleNamespace(shutting_down=False, note_error=None), usage=None, access_log=None)
    flag = parts_of(gw).switcher.parts.shutting_down
    assert not flag()
    gw.state.shutting_down = True
    assert flag()


# B: a drained server switched stays drained, here and in the other workers

def test_a_drained_server_stays_drained_after_its_switch_here_and_in_the_other_workers():
    pool = fleet()
    pool.get(P1).draining = True  # POST /admin/servers/drain
    told: list[dict] = []
    sw, _ = switcher(pool, lambda body: httpx.Response(200, json=OK))
    sw.parts = dataclasses.replace(sw.parts, tell=lambda op, url, **extra: told.append(
        {"kind": "admin", "op": op, "url": url, **extra}))  # as Siblings.admin_change
    answer = asyncio.run(sw.switch(SwitchAsk(P1, "decode", deadline=5)))
    assert answer["server"]["role"] == "decode" and answer["server"]["draining"] is True
    assert pool.get(P1).draining and not pool.get(P1).serving
    assert [m["op"] for m in told] == ["drain", "remove", "add", "drain"]
    other = fleet()  # another worker, which the operator's drain reached before
    other.get(P1).draining = True
    assert asyncio.run(apply_in_order(other, told)).draining  # pool.get(P1) in its new role
    hub = Hub()  # what a worker started again is given
    for msg in [{"kind": "admin", "op": "drain", "url": P1}, *told]:
        hub.remember(msg)
    assert [m["op"] for m in hub.replay() if m["url"] == P1] == ["remove", "add", "drain"]


async def apply_in_order(pool, told: list[dict]) -> Server:
    """The other worker applies the tells one after another (control_channel `_in_order`)."""
    async def register(url, role, port, require_probe=False, model=None):
        return pool.add(Server(url, role, verified=True, model=model))
    siblings = Siblings(None, pool, register, pool.remove, None, None)
    for msg in told:
        await siblings._apply(msg)
    server = pool.get(P1)
    assert server.role == "decode"
    return server


# C: a switch the shutdown cuts off answers a JSON 503 and stays cancelled

class Counted:
    """gateway_role_switches: the outcomes counted."""

    def __init__(self) -> None:
        self.outcomes: list[str] = []

    def labels(self, outcome: str) -> Counted:
        self.outcomes.append(outcome)
        return self

    def inc(self) -> None:
        pass


def uvicorn_cycle(body: dict) -> RequestResponseCycle:
    """uvicorn's own request cycle (what runs the app and answers its exceptions) on a
    recording transport, the request's body already read."""
    raw = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": PATH, "raw_path": PATH.encode(),
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 8000),
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(raw)).encode())]}
    transport = UvicornTransport()
    made = RequestResponseCycle(
        scope=scope, transport=transport, flow=FlowControl(transport),
        logger=logging.getLogger("t"), access_logger=logging.getLogger("t.access"),
        access_log=False, default_headers=[], message_event=asyncio.Event(),
        expect_100_continue=False, keep_alive=True, on_response=lambda: None)
    made.body, made.more_body = bytearray(raw), False
    made.message_event.set()
    return made


@pytest.mark.parametrize(("phase", "left"), [
    ("drain", "stays a prefill server, as it was"),
    ("switch", "is taken out"),
])
def test_a_switch_cut_off_by_the_shutdown_grace_answers_a_json_503_and_stays_cancelled(
        phase, left):
    """uvicorn cancels the request's task when --shutdown-grace ends (before: its plain-text
    500, no count, no access-log line, no recent error); the client now reads a JSON 503
    from uvicorn's own cycle, and the cancellation still leaves the app."""
    pool = fleet()
    if phase == "drain":
        pool.get(P1).in_flight = 1  # the switch waits for it
    counted, errors, records, escaped = Counted(), [], [], []
    made = uvicorn_cycle({"url": P1, "role": "decode", "deadline": 30})

    async def main() -> None:
        hanging = asyncio.Event()

        async def answer(body: dict) -> httpx.Response:
            if body.get("prepare_only"):
                return httpx.Response(200, json=READY)
            hanging.set()
            await asyncio.Event().wait()  # the switch itself never answers
        sw, _ = switcher(pool, answer)
        parts = RoleSwitchParts(sw, counted, lambda err, path, rid: errors.append(err),
                                Usage(None, str), records.append)
        auth = SimpleNamespace(caller=lambda scope, role: None)
        app = Starlette(routes=[Route(PATH, guarded(switch_role, ADMIN, auth, parts),
                                      methods=["POST"])], exception_handlers=HANDLERS)

        async def watched(scope, receive, send) -> None:
            try:
                await app(scope, receive, send)
            except asyncio.CancelledError:
                escaped.append(True)
                raise
        task = asyncio.ensure_future(made.run_asgi(watched))
        await until(hanging.is_set if phase == "switch" else lambda: pool.get(P1).draining)
        task.cancel(msg="Task cancelled, timeout graceful shutdown exceeded")  # uvicorn's
        await asyncio.wait([task], timeout=5)
        assert task.done()
    asyncio.run(main())
    assert escaped == [True]  # the cancellation went on, out of the app
    head, _, body = b"".join(made.transport.writes).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 "), head
    assert b"content-type: application/json" in head.lower()
    error = json.loads(body)["error"]
    assert error["type"] == "service_unavailable" and error["code"] == "role_switch_cancelled"
    assert "shutting down" in error["message"] and left in error["message"]
    assert counted.outcomes == ["cancelled"]
    assert [r.status for r in records] == [503] and records[0].decode == P1
    assert [e.status for e in errors] == [503]
    server = pool.get(P1)
    if phase == "drain":
        assert put_back(server)
    else:
        assert server.misconfigured and not server.serving
    assert pool.get(P0).serving
