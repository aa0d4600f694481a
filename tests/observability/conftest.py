"""A real gateway in front of the simulated cluster, shared by the Prometheus and browser
tests, plus the checks for the external tools they need."""

from __future__ import annotations

import importlib.util
import shutil

import pytest

from tests.integration.conftest import sim_cluster
from tests.observability.traffic import ADMISSION_ARGS
from tests.procs import ROOT

ARTIFACTS = ROOT / "artifacts"
DEPLOY = ROOT / "deploy"
SETUP_HINT = "install it with .ci/setup-extras"

# Short health and load polls, so the status page and the gauges follow the servers closely.
GATEWAY_ARGS = [*ADMISSION_ARGS, "--health-interval", "1", "--loads-interval", "1"]


def require_binaries(*names: str) -> dict[str, str]:
    """Paths of the named executables; skips the test, naming what is missing."""
    found = {name: shutil.which(name) for name in names}
    missing = [name for name, path in found.items() if path is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed; {SETUP_HINT}")
    return found


def require_module(name: str) -> None:
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"Python package {name} not installed; {SETUP_HINT}")


@pytest.fixture(scope="session")
def observed(tmp_path_factory):
    """1 prefill + 2 decode simulated servers and the gateway, as real processes."""
    with sim_cluster(tmp_path_factory.mktemp("observed-logs"), gateway_args=GATEWAY_ARGS) as c:
        yield c
