"""The default topology with the real simulator (`python -m backends.sim`), once it exists."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util

import httpx
import pytest

from backends.launcher import Launcher, ServerState, default_topology
from tests.launcher.conftest import assert_gone

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("backends.sim.__main__") is None,
    reason="backends.sim has no __main__ yet (another engineer is writing it)",
)


def test_default_sim_topology_starts_serves_health_and_stops(tmp_path: object) -> None:
    topology = default_topology(log_dir=str(tmp_path), readiness_timeout_s=60)

    async def scenario() -> list[int]:
        async with Launcher(topology, progress=False, handle_signals=False) as launcher:
            assert [s.state for s in launcher.servers] == [ServerState.READY] * 3
            async with httpx.AsyncClient(trust_env=False) as client:
                for server in launcher.servers:
                    assert (await client.get(server.url + "/health")).status_code == 200
            return [s.pid for s in launcher.servers if s.pid is not None]

    assert_gone(asyncio.run(scenario()))


def test_real_sim_crash_is_restarted(tmp_path: object) -> None:
    """`--crash-after 1` makes the sim exit on its second generation request."""
    topology = default_topology(
        log_dir=str(tmp_path),
        decode=1,
        readiness_timeout_s=60,
        defaults={"decode": {"args": ["--crash-after", "1"]}},
        restart={"initial_backoff_s": 0.1},
    )
    events: list[tuple[str, ServerState]] = []

    async def scenario() -> None:
        launcher = Launcher(
            topology,
            lambda server, state: events.append((server.name, state)),
            progress=False,
            handle_signals=False,
        )
        async with launcher:
            decode = launcher.server("decode-0")
            async with httpx.AsyncClient(trust_env=False) as client:
                for _ in range(2):
                    with contextlib.suppress(httpx.HTTPError):
                        await client.post(decode.url + "/generate", json={"text": "hi"})
            deadline = asyncio.get_running_loop().time() + 30
            while not (decode.restarts == 1 and decode.state is ServerState.READY):
                assert asyncio.get_running_loop().time() < deadline, events
                await asyncio.sleep(0.05)
            assert decode.last_exit_code == 17

    asyncio.run(scenario())
    assert [state for name, state in events if name == "decode-0"] == [
        ServerState.STARTING,
        ServerState.READY,
        ServerState.CRASHED,
        ServerState.RESTARTING,
        ServerState.STARTING,
        ServerState.READY,
        ServerState.STOPPED,
    ]
