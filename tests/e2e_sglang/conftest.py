"""Session fixture: real SGLang 0.5.23 servers on the CPU rig, started with our launcher.

`sglang_cluster` generates the tiny model, then launches `deploy/cpu-rig/topology.yaml`
(1 prefill + 2 decode) plus one plain `--disaggregation-mode null` server for reference output,
and yields an `SglangCluster` with their URLs and bootstrap ports. It is skipped, with the
command to run, when the rig venv has not been built. Gateway-level tests can reuse it as is.
Server logs: $SGLANG_E2E_LOG_DIR if set, else a pytest temporary directory (see cluster.log_dir).
"""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from backends.launcher import BackgroundLauncher, ServerHandle, StartupError, topology_from_dict

REPO = Path(__file__).resolve().parents[2]
TOPOLOGY_FILE = REPO / "deploy/cpu-rig/topology.yaml"
MAKE_MODEL = REPO / "backends/sglang_cpu/make_tiny_model.py"
RIG_DIR = Path(os.environ.get("SGLANG_RIG_DIR", "/opt/sglang-rig"))
RIG_PYTHON = RIG_DIR / "venv/bin/python"
RIG_STAMP = RIG_DIR / ".rig-complete"
MODEL_NAME = "tiny-llama"


@dataclass(frozen=True)
class SglangServer:
    """One running server as tests see it."""

    name: str
    role: str
    url: str
    host: str
    bootstrap_port: int | None
    log_path: Path


@dataclass(frozen=True)
class SglangCluster:
    """The running servers; `pd_body` turns a request body into the body both PD legs get."""

    prefill: tuple[SglangServer, ...]
    decode: tuple[SglangServer, ...]
    null: SglangServer
    model_path: Path
    model_name: str
    log_dir: Path
    launcher: BackgroundLauncher

    @property
    def prefill_urls(self) -> list[str]:
        return [server.url for server in self.prefill]

    @property
    def decode_urls(self) -> list[str]:
        return [server.url for server in self.decode]

    @property
    def null_url(self) -> str:
        return self.null.url

    def pd_body(self, body: dict[str, Any], prefill: int = 0) -> dict[str, Any]:
        """`body` plus bootstrap_host/port of prefill[prefill] and a fresh bootstrap_room."""
        server = self.prefill[prefill]
        return {
            **body,
            "bootstrap_host": server.host,
            "bootstrap_port": server.bootstrap_port,
            "bootstrap_room": secrets.randbits(63),
        }


def _server(handle: ServerHandle) -> SglangServer:
    return SglangServer(
        handle.name,
        handle.role,
        handle.url,
        handle.spec.host,
        handle.bootstrap_port,
        handle.log_path,
    )


def make_model(out_dir: Path) -> Path:
    """Run make_tiny_model.py with the rig's python (it has torch and transformers)."""
    subprocess.run(
        [str(RIG_PYTHON), str(MAKE_MODEL), str(out_dir)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return out_dir


@pytest.fixture(scope="session")
def sglang_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SglangCluster]:
    if not (RIG_PYTHON.exists() and RIG_STAMP.exists()):
        pytest.skip(
            f"SGLang CPU rig not built at {RIG_DIR} (set SGLANG_RIG_DIR, or run "
            "backends/sglang_cpu/build_rig.sh first)"
        )
    model_path = make_model(tmp_path_factory.mktemp("tiny-model"))
    log_dir = Path(os.environ.get("SGLANG_E2E_LOG_DIR") or tmp_path_factory.mktemp("sglang-logs"))
    spec = yaml.safe_load(TOPOLOGY_FILE.read_text())
    spec.update(
        model_path=str(model_path),
        model_name=MODEL_NAME,
        log_dir=str(log_dir),
        plain=1,
        readiness_timeout_s=240,
    )
    variables = {**os.environ, "TOPOLOGY_DIR": str(TOPOLOGY_FILE.parent)}
    topology = topology_from_dict(spec, variables=variables)
    launcher = BackgroundLauncher(topology, progress=True)
    try:
        launcher.start()
    except StartupError as exc:
        pytest.fail(f"SGLang servers did not start (logs in {log_dir}):\n{exc}")
    servers = launcher.servers
    try:
        yield SglangCluster(
            prefill=tuple(_server(s) for s in servers if s.role == "prefill"),
            decode=tuple(_server(s) for s in servers if s.role == "decode"),
            null=next(_server(s) for s in servers if s.role == "plain"),
            model_path=model_path,
            model_name=MODEL_NAME,
            log_dir=log_dir,
            launcher=launcher,
        )
    finally:
        launcher.stop()
