"""Helpers for launcher tests: stand-in sim topologies and checks that processes are gone."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from backends.launcher import Topology, topology_from_dict
from backends.launcher.process import group_members

STANDIN_DIR = Path(__file__).parent / "standin"


def pid_alive(pid: int) -> bool:
    """True if `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def assert_gone(pgids: list[int], timeout: float = 10.0) -> None:
    """Every process group in `pgids` has no live member left."""
    assert wait_until(lambda: not any(group_members(g) for g in pgids), timeout), {
        g: group_members(g) for g in pgids
    }


@pytest.fixture
def standin_topology(tmp_path: Path) -> Callable[..., Topology]:
    """Factory: a `sim` topology that runs tests/launcher/standin on free loopback ports."""

    def make(**spec: Any) -> Topology:
        data: dict[str, Any] = {
            "backend": "sim",
            "cwd": str(STANDIN_DIR),
            "log_dir": str(tmp_path / "logs"),
            "prefill": 1,
            "decode": 2,
            "readiness_timeout_s": 15,
            "health_interval_s": 0.1,
            "stop_grace_s": 3,
            "restart": {"initial_backoff_s": 0.1, "max_backoff_s": 0.5, "max_restarts": 3},
        }
        data.update(spec)
        return topology_from_dict(data, variables=dict(os.environ))

    return make
