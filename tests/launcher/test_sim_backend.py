"""The default topology with the real simulator (`python -m backends.sim`), once it exists."""

from __future__ import annotations

import asyncio
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
