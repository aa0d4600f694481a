"""A real gateway in front of the simulated cluster, shared by the Prometheus and browser
tests, plus the checks for the external tools they need."""

from __future__ import annotations

import importlib.util
import os
import shutil

import pytest

from tests.integration.conftest import sim_cluster
from tests.observability.traffic import ADMISSION_ARGS
from tests.procs import ROOT

ARTIFACTS = ROOT / "artifacts"
DEPLOY = ROOT / "deploy"
SETUP_HINT = ".ci/setup-extras installs it"

# Short health and load polls, so the status page and the gauges follow the servers closely;
# a short breaker cooldown, so a server the traffic's faults took out of rotation is back soon.
GATEWAY_ARGS = [*ADMISSION_ARGS, "--health-interval", "1", "--loads-interval", "1",
                "--breaker-cooldown", "1"]


def missing_tool(what: str) -> None:
    """Skip on a developer's machine; fail in CI, which runs .ci/setup-extras first (a
    skipped test there would hide a broken install step)."""
    reason = f"{what} not installed; {SETUP_HINT}"
    if os.environ.get("CI") == "true":
        pytest.fail(reason)
    pytest.skip(reason)


def require_binaries(*names: str) -> dict[str, str]:
    """Paths of the named executables; skips the test, naming what is missing."""
    found = {name: shutil.which(name) for name in names}
    missing = [name for name, path in found.items() if path is None]
    if missing:
        missing_tool(", ".join(missing))
    return found


def require_module(name: str) -> None:
    if importlib.util.find_spec(name) is None:
        missing_tool(f"Python package {name}")


@pytest.fixture(scope="session")
def observed(tmp_path_factory):
    """1 prefill + 2 decode simulated servers and the gateway, as real processes."""
    with sim_cluster(tmp_path_factory.mktemp("observed-logs"), gateway_args=GATEWAY_ARGS) as c:
        yield c
