"""Session fixture: real SGLang 0.5.23 servers on the CPU rig, started with our launcher.

`sglang_cluster` generates the tiny model, starts one plain `--disaggregation-mode null` server
for reference output, then runs `python -m gateway --launch --launch-config
deploy/cpu-rig/topology.yaml`: the gateway itself launches, supervises and registers 1 prefill +
2 decode servers. It yields an `SglangCluster` with the gateway URL and the servers' URLs and
bootstrap ports (as the gateway lists them). It is skipped, with the
command to run, when the rig venv has not been built. Gateway-level tests can reuse it as is.
Server logs: $SGLANG_E2E_LOG_DIR if set, else a pytest temporary directory (see cluster.log_dir).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml

from backends.launcher import BackgroundLauncher, ServerHandle, StartupError, topology_from_dict
from tests.procs import Proc, free_port, python

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
    launcher: BackgroundLauncher  # the plain reference server
    gateway: str  # the gateway that launched and serves the prefill and decode servers
    gateway_proc: Proc

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

    async def pd_generate(
        self, body: dict[str, Any], decode: int = 0, prefill: int = 0
    ) -> tuple[httpx.Response, httpx.Response]:
        """The same body (plus bootstrap fields) to a prefill and a decode at once, as a
        router does: the transfer between exactly these two servers, with no gateway."""
        pd_body = self.pd_body(body, prefill)
        async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
            return await asyncio.gather(
                client.post(self.prefill_urls[prefill] + "/generate", json=pd_body),
                client.post(self.decode_urls[decode] + "/generate", json=pd_body),
            )


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


def require_rig() -> None:
    """Skip, saying how to build it, when the rig venv is not there."""
    if not (RIG_PYTHON.exists() and RIG_STAMP.exists()):
        pytest.skip(
            f"SGLang CPU rig not built at {RIG_DIR} (set SGLANG_RIG_DIR, or run "
            "backends/sglang_cpu/build_rig.sh first)"
        )


def start_gateway(model_path: Path, log_dir: Path, topology: Path = TOPOLOGY_FILE,
                  extra_args: tuple[str, ...] = ()) -> tuple[Proc, str]:
    """`python -m gateway --launch` with a CPU-rig topology (by default 1 prefill + 2 decode):
    the gateway starts, supervises and registers the real SGLang servers itself."""
    port = free_port()
    env = {"SGLANG_TINY_MODEL": str(model_path), "LAUNCHER_LOG_DIR": str(log_dir),
           "SGLANG_RIG_DIR": str(RIG_DIR)}
    argv = python("-m", "gateway", "--launch", "--launch-config", str(topology),
                  "--port", str(port), "--log-level", "info", "--health-interval", "3",
                  *extra_args)
    proc = Proc("gateway", argv, log_dir, env)
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_http(url + "/readiness", timeout=600)
    except BaseException:
        proc.stop(grace=30)
        raise
    return proc, url


def _plain_server(model_path: Path, log_dir: Path) -> BackgroundLauncher:
    spec = yaml.safe_load(TOPOLOGY_FILE.read_text())
    spec.update(model_path=str(model_path), model_name=MODEL_NAME, log_dir=str(log_dir),
                prefill=0, decode=0, plain=1, readiness_timeout_s=300)
    variables = {**os.environ, "TOPOLOGY_DIR": str(TOPOLOGY_FILE.parent)}
    return BackgroundLauncher(topology_from_dict(spec, variables=variables), progress=True)


@pytest.fixture(scope="session")
def sglang_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SglangCluster]:
    require_rig()
    model_path = make_model(tmp_path_factory.mktemp("tiny-model"))
    log_dir = Path(os.environ.get("SGLANG_E2E_LOG_DIR") or tmp_path_factory.mktemp("sglang-logs"))
    launcher = _plain_server(model_path, log_dir / "plain")
    try:
        launcher.start()
    except StartupError as exc:
        pytest.fail(f"the plain SGLang server did not start (logs in {log_dir}):\n{exc}")
    try:
        gateway, url = start_gateway(model_path, log_dir)
    except BaseException:
        launcher.stop()
        raise
    try:
        listed = httpx.get(url + "/admin/servers", timeout=30).json()["servers"]
        plain = next(s for s in launcher.servers if s.role == "plain")
        yield SglangCluster(
            prefill=tuple(_listed(s, log_dir) for s in listed if s["role"] == "prefill"),
            decode=tuple(_listed(s, log_dir) for s in listed if s["role"] == "decode"),
            null=_server(plain),
            model_path=model_path,
            model_name=MODEL_NAME,
            log_dir=log_dir,
            launcher=launcher,
            gateway=url,
            gateway_proc=gateway,
        )
    finally:
        gateway.stop(grace=60)
        launcher.stop()
    left = sglang_processes(model_path)
    assert not left, f"SGLang processes left after the gateway stopped: {left}"


def sglang_processes(model_path: Path) -> list[int]:
    """Pids of live processes whose command line names this session's model."""
    needle = str(model_path).encode()
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if needle in cmdline.read_bytes():
                pids.append(int(cmdline.parent.name))
        except OSError:
            continue
    return pids


def _listed(server: dict, log_dir: Path) -> SglangServer:
    host = urlsplit(server["url"]).hostname
    return SglangServer(server["url"], server["role"], server["url"], host,
                        server["bootstrap_port"], log_dir)


QUIET_WAIT = 180.0  # seconds a test waits for the shared rig to finish what earlier ones left
QUIET_BUDGET = [300.0]  # seconds all tests of the session may wait so, together (a rig that
# never gets quiet must not hold each of 70 tests for QUIET_WAIT)


def busy_on(url: str) -> int:
    """Requests a real server still holds: running, queued, or in a PD queue (bootstrap,
    transfer, preallocation). SGLang's `/v1/loads` (`LoadSnapshot`, its `disaggregation`
    section)."""
    loads = httpx.get(url + "/v1/loads", timeout=5, trust_env=False).json()["loads"]
    held = 0
    for load in loads:
        disagg = load.get("disaggregation") or {}
        held += int(load.get("num_running_reqs") or 0) + int(load.get("num_waiting_reqs") or 0)
        held += sum(int(disagg.get(key) or 0) for key in (
            "prefill_bootstrap_queue_reqs", "prefill_inflight_queue_reqs",
            "decode_prealloc_queue_reqs", "decode_transfer_queue_reqs"))
    return held


@pytest.fixture(autouse=True)
def quiet_rig(request: pytest.FixtureRequest) -> None:
    """Before a test on the shared rig: wait (bounded) until no server holds a request.

    Why: the rig is one set of real servers for the whole session, and an earlier test's
    aborted streams can leave a KV transfer that real SGLang finishes only minutes later
    (CI, 2026-12-04: a prefill kept one request in its inflight queue for 2.5 minutes after
    a storm of client disconnects, and every new transfer to one decode waited behind it, so
    the next tests that sent to that decode timed out). A test starts on a quiet rig, as a
    user's first request would; past `QUIET_WAIT` it starts anyway and its own assertions
    say what is wrong."""
    if "sglang_cluster" not in request.fixturenames:
        return
    cluster: SglangCluster = request.getfixturevalue("sglang_cluster")
    urls = [s.url for s in (*cluster.prefill, *cluster.decode)]
    started = time.monotonic()
    deadline = started + min(QUIET_WAIT, QUIET_BUDGET[0])
    try:
        while time.monotonic() < deadline:
            try:
                if sum(busy_on(url) for url in urls) == 0:
                    return
            except (httpx.HTTPError, KeyError, TypeError, ValueError):
                return  # a server that does not answer: the test itself will say so
            time.sleep(0.5)
    finally:
        QUIET_BUDGET[0] = max(0.0, QUIET_BUDGET[0] - (time.monotonic() - started))
