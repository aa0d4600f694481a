"""Validation before start: every problem listed, nothing started."""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from backends.launcher import (
    Launcher,
    ServerSpec,
    Topology,
    TopologyError,
    find_problems,
    validate,
)

LOCAL = "127.0.0.1"


def topo(*servers: ServerSpec, backend: str = "sglang", **kw: object) -> Topology:
    kw.setdefault("model_path", "org/model")  # a hub id: not checked on disk
    kw.setdefault("python", sys.executable)
    return Topology(backend=backend, servers=servers, **kw)  # type: ignore[arg-type]


def prefill(port: int, boot: int | None = 8998, **kw: object) -> ServerSpec:
    return ServerSpec("prefill", kw.pop("index", 0), kw.pop("host", LOCAL), port, boot, **kw)  # type: ignore[arg-type]


def decode(port: int, index: int = 0, **kw: object) -> ServerSpec:
    return ServerSpec("decode", index, kw.pop("host", LOCAL), port, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("topology", "expected"),
    [
        pytest.param(
            topo(prefill(30000, tp_size=2), decode(30001, base_gpu_id=1)),
            ["prefill-0 (GPUs 0-1) and decode-0 (GPUs 1) overlap on GPU 1 of this machine"],
            id="gpu-overlap",
        ),
        pytest.param(
            topo(
                prefill(30000),
                prefill(30001, index=1, base_gpu_id=1),
                decode(30002, base_gpu_id=2),
            ),
            [
                "prefill-0 and prefill-1: two prefills on host 127.0.0.1 share bootstrap port "
                "8998; give each its own bootstrap_port"
            ],
            id="shared-bootstrap-port",
        ),
        pytest.param(
            topo(prefill(30000), decode(30000, base_gpu_id=1)),
            ["duplicate 127.0.0.1:30000: prefill-0 port and decode-0 port"],
            id="duplicate-host-port",
        ),
        pytest.param(
            topo(prefill(30000, host="0.0.0.0"), decode(30000, base_gpu_id=1)),
            ["duplicate 0.0.0.0:30000: prefill-0 port and decode-0 port"],
            id="wildcard-clashes-with-loopback",
        ),
        pytest.param(
            topo(prefill(30000, boot=30001), decode(30001, base_gpu_id=1)),
            ["duplicate 127.0.0.1:30001: decode-0 port and prefill-0 bootstrap_port"],
            id="bootstrap-port-vs-http-port",
        ),
        pytest.param(
            topo(prefill(30000), decode(30001, base_gpu_id=1), model_path=None),
            ["model_path: required for the sglang backend"],
            id="no-model-path",
        ),
        pytest.param(
            topo(prefill(30000), decode(30001, base_gpu_id=1), model_path="/no/such/model"),
            ["model_path: /no/such/model does not exist"],
            id="missing-model-dir",
        ),
        pytest.param(
            topo(prefill(30000), decode(30001, base_gpu_id=1), python="/no/rig/bin/python"),
            ["python: /no/rig/bin/python is not an executable file (build the rig first?)"],
            id="missing-python",
        ),
        pytest.param(
            topo(prefill(30000)),
            ["PD needs both roles: 1 prefill and 0 decode"],
            id="prefill-without-decode",
        ),
        pytest.param(
            topo(prefill(30000, boot=None), decode(30001, base_gpu_id=1)),
            ["prefill-0: prefill servers need a bootstrap_port"],
            id="prefill-without-bootstrap",
        ),
        pytest.param(
            topo(prefill(30000), decode(70000, host="192.0.2.1", tp_size=0, base_gpu_id=1)),
            [
                "decode-0: port 70000 is not in 1..65535",
                "decode-0: tp_size must be >= 1 (got 0)",
                "decode-0: host '192.0.2.1' is not an address of this machine "
                "(the launcher starts every server here)",
            ],
            id="bad-server-fields",
        ),
        pytest.param(
            topo(prefill(30000), decode(30001), backend="sim", model_path=None),
            [],
            id="sim-needs-no-model-and-shares-gpu-ids",
        ),
        pytest.param(
            topo(prefill(30000), decode(30001), device="cpu"),
            [],
            id="cpu-device-shares-gpu-ids",
        ),
    ],
)
def test_problems(topology: Topology, expected: list[str]) -> None:
    assert find_problems(topology, check_ports=False) == expected


def test_existing_model_dir_is_accepted(tmp_path: Path) -> None:
    topology = topo(prefill(30000), decode(30001, base_gpu_id=1), model_path=str(tmp_path))
    assert find_problems(topology, check_ports=False) == []


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind((LOCAL, 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_port_in_use_is_reported_and_nothing_starts(busy_port: int, tmp_path: Path) -> None:
    topology = topo(
        prefill(busy_port),
        decode(busy_port + 1 if busy_port < 65535 else 1024, base_gpu_id=1),
        backend="sim",
        log_dir=tmp_path / "logs",
    )
    with pytest.raises(TopologyError) as info:
        validate(topology)
    assert f"prefill-0: port 127.0.0.1:{busy_port} is already in use" in info.value.problems

    launcher = Launcher(topology, progress=False)
    with pytest.raises(TopologyError):
        import asyncio

        asyncio.run(launcher.start())
    assert all(server.pid is None for server in launcher.servers)
    assert not (tmp_path / "logs").exists()
