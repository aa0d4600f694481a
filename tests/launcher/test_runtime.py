"""Runtime: start -> ready, crash -> restart, startup failures, and stop leaving no process."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from backends.launcher import (
    BackgroundLauncher,
    Launcher,
    ServerHandle,
    ServerState,
    StartupError,
    Topology,
)
from tests.launcher.conftest import assert_gone, pid_alive

S = ServerState


async def until(predicate: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


def recorder() -> tuple[list[tuple[str, ServerState]], Callable[..., None]]:
    events: list[tuple[str, ServerState]] = []
    return events, lambda server, state: events.append((server.name, state))


def states_of(events: list[tuple[str, ServerState]], name: str) -> list[ServerState]:
    return [state for server, state in events if server == name]


def launcher_for(topology: Topology, on_state: Any = None, **kw: Any) -> Launcher:
    kw.setdefault("progress", False)
    kw.setdefault("handle_signals", False)
    return Launcher(topology, on_state, **kw)


def test_start_kill9_crashed_restarted_ready_then_stop_leaves_nothing(
    standin_topology: Callable[..., Topology],
) -> None:
    events, on_state = recorder()

    async def scenario() -> list[int]:
        launcher = launcher_for(standin_topology(), on_state)
        await launcher.start()
        assert [s.state for s in launcher.servers] == [S.READY] * 3
        victim = launcher.server("decode-1")
        old_pid = victim.pid
        assert old_pid is not None
        os.kill(old_pid, signal.SIGKILL)
        await until(lambda: victim.restarts == 1 and victim.state is S.READY)
        assert victim.pid not in (None, old_pid)
        assert victim.last_exit_code == -signal.SIGKILL
        async with httpx.AsyncClient(trust_env=False) as client:
            assert (await client.get(victim.url + "/health")).status_code == 200
        pgids = [old_pid] + [s.pid for s in launcher.servers if s.pid is not None]
        await launcher.stop()
        assert all(s.pid is None for s in launcher.servers)
        return pgids

    pgids = asyncio.run(scenario())
    assert_gone(pgids)
    assert states_of(events, "decode-1") == [
        S.STARTING,
        S.READY,
        S.CRASHED,
        S.RESTARTING,
        S.STARTING,
        S.READY,
        S.STOPPED,
    ]
    assert states_of(events, "decode-0") == [S.STARTING, S.READY, S.STOPPED]


def test_a_crashed_server_stays_down_for_its_hold(
    standin_topology: Callable[..., Topology], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The restart waits for the longer of the backoff (0.1 s here) and the hold that lets
    SGLang decodes forget the dead prefill (heartbeat.py; the standins are `sim` servers,
    which need none, so the test gives the prefill one)."""
    import backends.launcher.launcher as launcher_module

    monkeypatch.setattr(launcher_module, "restart_hold_s",
                        lambda topology, spec, environ: 1.5 if spec.role == "prefill" else 0.0)
    stamps: list[tuple[str, ServerState, float]] = []

    async def scenario() -> None:
        launcher = launcher_for(standin_topology(), lambda server, state: stamps.append(
            (server.name, state, time.monotonic())))
        await launcher.start()
        for name in ("decode-0", "prefill-0"):
            victim = launcher.server(name)
            os.kill(victim.pid or 0, signal.SIGKILL)
            await until(lambda v=victim: v.restarts == 1 and v.state is S.READY)
        await launcher.stop()

    asyncio.run(scenario())

    def down_for(name: str) -> float:
        last = {state: t for server, state, t in stamps if server == name}  # the restart's
        return last[S.STARTING] - last[S.CRASHED]

    assert down_for("prefill-0") >= 1.5
    assert down_for("decode-0") < 1.5


def test_stop_kills_grandchildren_and_escalates_to_sigkill(
    standin_topology: Callable[..., Topology],
) -> None:
    topology = standin_topology(
        stop_grace_s=0.5, defaults={"decode": {"args": ["--spawn-child", "--ignore-sigterm"]}}
    )

    async def scenario() -> tuple[list[int], list[int], float]:
        launcher = launcher_for(topology)
        await launcher.start()
        await asyncio.sleep(0.3)  # the child pid is logged right after start
        children = []
        for server in launcher.by_role("decode"):
            match = re.search(r"standin child pid (\d+)", server.log_path.read_text())
            assert match, server.log_path.read_text()
            children.append(int(match.group(1)))
        pgids = [s.pid for s in launcher.servers if s.pid is not None]
        started = time.monotonic()
        await launcher.stop()
        return pgids, children, time.monotonic() - started

    pgids, children, took = asyncio.run(scenario())
    assert_gone(pgids)
    assert not any(pid_alive(pid) for pid in children)
    assert 0.5 <= took < 5.0  # waited the grace period for SIGTERM-ignoring servers, then killed


def test_crash_during_start_fails_fast_and_cleans_up(
    standin_topology: Callable[..., Topology],
) -> None:
    topology = standin_topology(
        readiness_timeout_s=30,
        defaults={"decode": {"args": ["--ready-after", "30"]}},
        decode=[{}, {"args": ["--exit-after", "0.3"]}],
    )
    launcher = launcher_for(topology)
    started = time.monotonic()
    with pytest.raises(StartupError) as info:
        asyncio.run(launcher.start())
    assert time.monotonic() - started < 10
    message = str(info.value)
    assert "decode-1" in message and "exited with code 3" in message
    assert "standin decode on" in message  # the log tail is part of the error
    assert all(s.state is S.STOPPED and s.pid is None for s in launcher.servers)
    assert_gone([s.process._proc.pid for s in launcher.servers if s.process._proc])


def test_readiness_deadline(standin_topology: Callable[..., Topology]) -> None:
    topology = standin_topology(
        readiness_timeout_s=1, defaults={"prefill": {"args": ["--ready-after", "60"]}}
    )
    launcher = launcher_for(topology)
    with pytest.raises(StartupError, match=r"prefill-0 .* not ready within 1s"):
        asyncio.run(launcher.start())
    assert_gone([s.process._proc.pid for s in launcher.servers if s.process._proc])


def test_gives_up_after_max_restarts_in_a_row(standin_topology: Callable[..., Topology]) -> None:
    topology = standin_topology(
        decode=[{"args": ["--exit-after", "1"]}],
        restart={"initial_backoff_s": 0.1, "max_backoff_s": 0.2, "max_restarts": 2},
    )
    events, on_state = recorder()

    async def scenario() -> ServerHandle:
        launcher = launcher_for(topology, on_state)
        await launcher.start()
        victim = launcher.server("decode-0")
        await until(lambda: victim.gave_up, timeout=20)
        assert launcher.server("prefill-0").state is S.READY  # the others keep running
        await launcher.stop()
        return victim

    victim = asyncio.run(scenario())
    assert victim.restarts == 2
    cycle = [S.CRASHED, S.RESTARTING, S.STARTING, S.READY]
    assert states_of(events, "decode-0") == [
        S.STARTING,
        S.READY,
        *cycle,
        *cycle,
        S.CRASHED,
        S.STOPPED,
    ]


def test_stop_is_idempotent_and_safe_before_start(
    standin_topology: Callable[..., Topology],
) -> None:
    async def scenario() -> None:
        never_started = launcher_for(standin_topology())
        await never_started.stop()
        launcher = launcher_for(standin_topology())
        await launcher.start()
        await asyncio.gather(launcher.stop(), launcher.stop())
        await launcher.stop()
        await launcher.wait()

    asyncio.run(scenario())


def test_async_callback_and_failing_callback(standin_topology: Callable[..., Topology]) -> None:
    seen: list[str] = []

    async def on_state(server: ServerHandle, state: ServerState) -> None:
        await asyncio.sleep(0)
        seen.append(f"{server.name}:{state}")
        if state is S.READY:
            raise RuntimeError("a broken callback must not break the launcher")

    async def scenario() -> None:
        async with launcher_for(standin_topology(decode=1), on_state) as launcher:
            assert all(s.state is S.READY for s in launcher.servers)

    asyncio.run(scenario())
    assert seen.count("prefill-0:ready") == 1 and seen[-1].endswith(":stopped")


def test_logs_and_echo(
    standin_topology: Callable[..., Topology], capsys: pytest.CaptureFixture[str]
) -> None:
    async def scenario() -> ServerHandle:
        async with launcher_for(standin_topology(decode=1), echo=True) as launcher:
            await asyncio.sleep(0.2)
            return launcher.server("decode-0")

    server = asyncio.run(scenario())
    text = server.log_path.read_text()
    assert "=== launcher: start #1" in text and "-m backends.sim --mode decode" in text
    assert "standin decode on" in text
    assert "[decode-0] standin decode on" in capsys.readouterr().err


def test_background_launcher(standin_topology: Callable[..., Topology]) -> None:
    with BackgroundLauncher(standin_topology(), progress=False) as background:
        pgids = [s.pid for s in background.servers]
        assert all(s.state is S.READY for s in background.servers)
        response = httpx.get(background.servers[0].url + "/health", trust_env=False)
        assert response.status_code == 200
    assert_gone([pid for pid in pgids if pid is not None])
    background.stop()  # idempotent


def test_a_dead_leaders_group_is_stopped_before_its_restart(
    standin_topology: Callable[..., Topology],
) -> None:
    """SGLang's server leads a group (scheduler, detokenizer). Its leader killed alone, the
    rest lived on: the restart failed on "address already in use" while the orphan answered
    /health, and it outlived the gateway (2026-12-07). Now the group goes before the restart."""
    topology = standin_topology(decode=1, defaults={"decode": {"args": ["--spawn-child"]}})

    async def scenario() -> tuple[int, bool]:
        launcher = launcher_for(topology)
        await launcher.start()
        victim = launcher.server("decode-0")
        await until(lambda: "standin child pid" in victim.log_path.read_text())
        child = int(re.search(r"standin child pid (\d+)", victim.log_path.read_text()).group(1))
        os.kill(victim.pid or 0, signal.SIGKILL)  # the leader alone
        await until(lambda: victim.restarts == 1 and victim.state is S.READY)
        gone = not pid_alive(child)
        await launcher.stop()
        return child, gone

    child, gone = asyncio.run(scenario())
    assert gone, f"the dead leader's child {child} outlived the restart"
