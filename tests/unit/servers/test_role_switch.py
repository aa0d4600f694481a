"""The role-switch procedure against scripted SGLang answers (no sockets), its request
validation and its lock."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable

import httpx
import pytest

from gateway.errors import BadRequest, NotFound
from gateway.servers.pool import Server, ServerPool
from gateway.servers.probe import facts_from_info, live_mode
from gateway.servers.role_switch import (
    RoleSwitcher,
    SwitchAsk,
    SwitchBroken,
    SwitchParts,
    SwitchRefused,
)
from gateway.servers.switch_lock import SwitchBusy, SwitchLock

P0, P1, D0 = "http://p0:1", "http://p1:1", "http://d0:1"
OK = {"success": True, "message": "ok", "old_role": "prefill", "new_role": "decode",
      "safe_to_restore": False}


def fleet() -> ServerPool:
    pool = ServerPool()
    for url, role in ((P0, "prefill"), (P1, "prefill"), (D0, "decode")):
        pool.add(Server(url, role, verified=True, model="m"))
    return pool


def switcher(pool: ServerPool, answer: Callable[[dict], httpx.Response],
             told: list | None = None, hung: tuple[str, ...] = ()) -> tuple[RoleSwitcher, list[dict]]:
    """`answer(body)` scripts P1's /pd_role_switch; D0's /server_info reports its graphs;
    the servers in `hung` give their /health no answer."""
    asked: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            if f"http://{request.url.host}:1" in hung:
                raise httpx.ReadTimeout("no answer", request=request)
            return httpx.Response(200)
        if request.url.path == "/server_info":
            return httpx.Response(200, json={"internal_states": [
                {"decode_cuda_graph_memory_gb": 0.5, "decode_cuda_graph_bs": [1, 2]}]})
        body = json.loads(request.content)
        asked.append(body)
        return answer(body)

    async def register(url, role, port, require_probe=False, model=None):
        return pool.add(Server(url, role, verified=True, model=model))

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    tell = (lambda *a, **k: told.append(a)) if told is not None else (lambda *a, **k: None)
    parts = SwitchParts(pool, client, register, pool.remove, tell, 1.0, SwitchLock())
    return RoleSwitcher(parts), asked


def run(coro):
    return asyncio.run(coro)


def test_success_sends_the_peer_figures_and_moves_the_server():
    pool = fleet()
    told: list = []
    sw, asked = switcher(pool, lambda body: httpx.Response(200, json=OK), told)
    answer = run(sw.switch(SwitchAsk(P1, "decode", deadline=5)))
    assert answer["new_role"] == "decode" and answer["server"]["role"] == "decode"
    assert [s.url for s in pool.role("decode")] == [D0, P1]
    assert asked == [
        {"new_role": "decode", "decode_cuda_graph_memory_gb": 0.5, "decode_cuda_graph_bs": [1, 2],
         "prepare_only": True},
        {"new_role": "decode", "decode_cuda_graph_memory_gb": 0.5, "decode_cuda_graph_bs": [1, 2]}]
    assert [t[0] for t in told] == ["drain", "remove", "add"]
    assert not pool.get(P1).draining


def test_not_idle_is_asked_again_until_the_deadline_then_put_back():
    pool = fleet()
    busy = {"success": False, "message": "instance is not idle; drain all requests before "
            "switching", "safe_to_restore": True}
    sw, asked = switcher(pool, lambda body: httpx.Response(400, json=busy))
    with pytest.raises(SwitchRefused, match="not idle") as caught:
        run(sw.switch(SwitchAsk(P1, "decode", deadline=0.35)))
    assert caught.value.code == "role_switch_busy" and caught.value.status == 409
    assert len(asked) >= 3  # asked every 0.1 s
    server = pool.get(P1)
    assert (server.role, server.draining, server.misconfigured) == ("prefill", False, None)


def test_not_idle_then_ready_goes_on():
    pool = fleet()
    answers = iter([httpx.Response(400, json={"success": False, "safe_to_restore": True,
                                              "message": "instance is not idle; drain"}),
                    httpx.Response(200, json={**OK, "message": "ready"}),
                    httpx.Response(200, json=OK)])
    sw, asked = switcher(pool, lambda body: next(answers))
    run(sw.switch(SwitchAsk(P1, "decode", deadline=5)))
    assert [b.get("prepare_only", False) for b in asked] == [True, True, False]


@pytest.mark.parametrize(("answer", "kind", "code"), [
    pytest.param(httpx.Response(400, json={"success": False, "safe_to_restore": True,
                                           "message": "--enable-pd-role-switch is not set"}),
                 SwitchRefused, "role_switch_refused", id="safe-refusal"),
    pytest.param(httpx.Response(404, text="Not Found"), SwitchRefused, "role_switch_refused",
                 id="no-route"),
    pytest.param(httpx.Response(400, json={"success": False, "safe_to_restore": False,
                                           "message": "instance is unhealthy after a failed "
                                           "role switch; restart required"}),
                 SwitchBroken, "role_switch_failed", id="unsafe"),
])
def test_prepare_answers(answer, kind, code):
    pool = fleet()
    sw, asked = switcher(pool, lambda body: answer)
    with pytest.raises(kind) as caught:
        run(sw.switch(SwitchAsk(P1, "decode")))
    assert caught.value.code == code and len(asked) == 1
    server = pool.get(P1)
    if kind is SwitchRefused:
        assert (server.draining, server.misconfigured, server.healthy) == (False, None, True)
    else:
        assert server.draining and not server.healthy and "restart required" in \
            server.misconfigured


def test_no_answer_to_the_switch_itself_takes_the_server_out():
    pool = fleet()

    def answer(body: dict) -> httpx.Response:
        if body.get("prepare_only"):
            return httpx.Response(200, json={**OK, "message": "ready"})
        raise httpx.ReadTimeout("slow")
    sw, _ = switcher(pool, answer)
    with pytest.raises(SwitchBroken, match="its state is unknown"):
        run(sw.switch(SwitchAsk(P1, "decode")))
    assert not pool.get(P1).usable


def test_a_peer_dying_during_the_drain_refuses_the_switch_before_anything_is_asked():
    """P0, the other prefill, dies while P1 drains: the role would be left empty, so P1 is
    put back as it was and SGLang is never asked (before: the check ran only at the start,
    and the switch flipped the last live prefill)."""
    pool = fleet()
    busy = pool.get(P1)
    busy.in_flight = 1  # a request still runs there: the switch waits for it

    async def main():
        sw, asked = switcher(pool, lambda body: httpx.Response(200, json=OK))

        async def peer_dies_then_idle():
            await asyncio.sleep(0.1)
            pool.get(P0).healthy = False
            busy.in_flight = 0
        asyncio.get_running_loop().create_task(peer_dies_then_idle())
        with pytest.raises(SwitchRefused, match="last serving prefill") as caught:
            await sw.switch(SwitchAsk(P1, "decode", deadline=5))
        return caught.value, asked
    refused, asked = run(main())
    assert refused.code == "role_empty" and asked == []
    assert (busy.role, busy.draining, busy.misconfigured) == ("prefill", False, None)


def test_a_peer_dying_after_prepare_stops_the_switch_itself():
    pool = fleet()

    def answer(body: dict) -> httpx.Response:
        pool.get(P0).healthy = False  # dies while SGLang checks P1
        return httpx.Response(200, json={**OK, "message": "ready"})
    sw, asked = switcher(pool, answer)
    with pytest.raises(SwitchRefused) as caught:
        run(sw.switch(SwitchAsk(P1, "decode")))
    assert caught.value.code == "role_empty"
    assert [b.get("prepare_only", False) for b in asked] == [True]  # never the switch
    server = pool.get(P1)
    assert (server.role, server.draining, server.misconfigured) == ("prefill", False, None)


def test_a_server_a_failed_switch_took_out_is_told_to_the_other_workers():
    pool = fleet()
    told: list = []

    def answer(body: dict) -> httpx.Response:
        if body.get("prepare_only"):
            return httpx.Response(200, json={**OK, "message": "ready"})
        return httpx.Response(500, json={"success": False, "safe_to_restore": False,
                                         "message": "restart required"})
    sw, _ = switcher(pool, answer, told)
    with pytest.raises(SwitchBroken):
        run(sw.switch(SwitchAsk(P1, "decode")))
    assert [t[0] for t in told] == ["drain", "take_out"]
    assert told[-1][1] == P1


def test_refusals_before_anything_is_asked():
    pool = fleet()
    sw, asked = switcher(pool, lambda body: httpx.Response(200, json=OK))
    with pytest.raises(SwitchRefused) as empty:
        run(sw.switch(SwitchAsk(D0, "prefill")))
    assert empty.value.code == "role_empty"
    pool.get(P0).draining = True  # a draining peer does not count
    with pytest.raises(SwitchRefused, match="last serving prefill"):
        run(sw.switch(SwitchAsk(P1, "decode")))
    with pytest.raises(SwitchRefused) as same:
        run(sw.switch(SwitchAsk(D0, "decode")))
    assert same.value.code == "already_in_role"
    with pytest.raises(NotFound):
        run(sw.switch(SwitchAsk("http://nope:1", "decode")))
    assert asked == []


@pytest.mark.parametrize(("body", "field"), [
    pytest.param({"role": "decode"}, "'url'", id="no-url"),
    pytest.param({"url": P0, "role": "both"}, "'role'", id="role"),
    pytest.param({"url": P0, "role": "decode", "deadline": -1}, "'deadline'", id="deadline"),
    pytest.param({"url": P0, "role": "decode", "deadline": True}, "'deadline'", id="bool"),
    pytest.param({"url": P0, "role": "decode", "decode_cuda_graph_memory_gb": "1"},
                 "'decode_cuda_graph_memory_gb'", id="gb"),
    pytest.param({"url": P0, "role": "decode", "decode_cuda_graph_bs": [0]},
                 "'decode_cuda_graph_bs'", id="bs"),
])
def test_ask_validation(body, field):
    with pytest.raises(BadRequest, match=field):
        SwitchAsk.parse(body)


def test_the_lock_refuses_a_second_holder_here_and_through_the_file(tmp_path):
    path = str(tmp_path / "switch.lock")
    one, other = SwitchLock(path), SwitchLock(path)  # two processes' views of one file
    with one.hold("a", "a -> decode"):
        with pytest.raises(SwitchBusy, match="a -> decode"):
            with one.hold("b", "b"):
                pass
        with pytest.raises(SwitchBusy, match="another worker"):
            with other.hold("b", "b"):
                pass
    with other.hold("b", "b"):  # released
        pass


@pytest.mark.parametrize("with_workers", [True, False])
def test_the_lock_says_which_server_is_being_switched_here_and_in_another_worker(
        tmp_path, with_workers):
    path = str(tmp_path / "switch.lock") if with_workers else None
    one, other = SwitchLock(path), SwitchLock(path)
    assert not one.switching("http://a")
    with one.hold("http://a", "http://a -> decode"):
        assert one.switching("http://a") and not one.switching("http://b")
        # another worker reads the holder's server from the file; without workers there is
        # no other process
        assert other.switching("http://a") is with_workers
        assert not other.switching("http://b")
    assert not one.switching("http://a") and not other.switching("http://a")


@pytest.mark.parametrize(("info", "mode"), [
    pytest.param({"disaggregation_mode": "decode",
                  "internal_states": [{"disaggregation_mode": "prefill"}]}, "prefill",
                 id="switched: the schedulers' role wins"),
    pytest.param({"disaggregation_mode": "decode", "internal_states": [{}]}, "decode",
                 id="older server: the launch mode"),
    pytest.param({"disaggregation_mode": "prefill"}, "prefill", id="no internal states"),
])
def test_live_mode(info, mode):
    assert live_mode(info) == mode
    assert facts_from_info(info, "http://s:1", mode).mode == mode


def test_a_cancelled_switch_puts_the_server_back():
    pool = fleet()
    sw, asked = switcher(pool, lambda body: httpx.Response(200, json=OK))
    pool.get(P1).in_flight = 1  # a request of ours still runs there

    async def cancel_midway() -> None:
        task = asyncio.ensure_future(sw.switch(SwitchAsk(P1, "decode", deadline=30)))
        await asyncio.sleep(0.2)
        assert pool.get(P1).draining
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    run(cancel_midway())
    server = pool.get(P1)
    assert (server.role, server.draining, server.misconfigured, asked) == (
        "prefill", False, None, [])
    assert sw.parts.lock.holder is None


@pytest.mark.parametrize(("refusals", "switched"), [(2, True), (10, False)],
                         ids=["answers-its-new-role-late", "never-does"])
def test_the_new_role_is_verified_again_and_again(monkeypatch, refusals, switched):
    monkeypatch.setattr("gateway.servers.role_switch.VERIFY_EVERY", 0.0)
    pool = fleet()
    sw, _ = switcher(pool, lambda body: httpx.Response(200, json=OK))
    left = [refusals]
    register = sw.parts.register

    async def late(url, role, port, require_probe=False, model=None):
        if left[0]:
            left[0] -= 1
            raise BadRequest(f"{url} was given as a {role} server but runs with "
                             "--disaggregation-mode prefill")
        return await register(url, role, port, require_probe, model)
    sw.parts = dataclasses.replace(sw.parts, register=late)
    if switched:
        assert run(sw.switch(SwitchAsk(P1, "decode")))["server"]["role"] == "decode"
    else:
        with pytest.raises(SwitchBroken) as caught:
            run(sw.switch(SwitchAsk(P1, "decode")))
        assert caught.value.code == "role_switch_unverified" and pool.get(P1) is None


def test_a_peer_that_hung_since_its_last_health_check_does_not_count():
    """The other prefill still reads serving (its health checks have not failed yet) but
    answers nothing now: switching the last one that answers would leave the role to a hung
    server. Refused, nothing asked of the server, not left drained."""
    pool = fleet()
    sw, asked = switcher(pool, lambda body: httpx.Response(200, json=OK), hung=(P0,))
    with pytest.raises(SwitchRefused) as refused:
        run(sw.switch(SwitchAsk(P1, "decode", deadline=5)))
    assert refused.value.code == "role_empty" and "answered its health check" in str(refused.value)
    assert asked == [] and pool.get(P1).role == "prefill" and not pool.get(P1).draining
