"""Command building: the exact argv and env per backend and role, and the dry-run text."""

from __future__ import annotations

import shlex

import pytest

from backends.launcher import ServerSpec, Topology, build_command, dry_run_text
from backends.launcher.commands import REPO_ROOT, LaunchCommand

PREFILL = ServerSpec("prefill", 0, "10.0.0.1", 30000, bootstrap_port=8998, tp_size=2)
DECODE = ServerSpec("decode", 0, "10.0.0.1", 30001, tp_size=2, base_gpu_id=2, ib_device="mlx5_0")
PLAIN = ServerSpec("plain", 0, "127.0.0.1", 30002, args=("--enable-metrics",))


def topo(backend: str = "sglang", **kw: object) -> Topology:
    return Topology(backend=backend, servers=(), python="py", model_path="/m", **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("topology", "server", "expected"),
    [
        pytest.param(
            topo(),
            PREFILL,
            "py -m sglang.launch_server --model-path /m --disaggregation-mode prefill "
            "--host 10.0.0.1 --port 30000 --tp-size 2 --base-gpu-id 0 "
            "--disaggregation-bootstrap-port 8998 --disaggregation-transfer-backend mooncake",
            id="sglang-prefill",
        ),
        pytest.param(
            topo(),
            DECODE,
            "py -m sglang.launch_server --model-path /m --disaggregation-mode decode "
            "--host 10.0.0.1 --port 30001 --tp-size 2 --base-gpu-id 2 "
            "--disaggregation-ib-device mlx5_0 --disaggregation-transfer-backend mooncake",
            id="sglang-decode-with-ib-device",
        ),
        pytest.param(
            topo(device="cpu", model_name="tiny"),
            PLAIN,
            "py -m sglang.launch_server --model-path /m --disaggregation-mode null "
            "--host 127.0.0.1 --port 30002 --tp-size 1 --base-gpu-id 0 --device cpu "
            "--served-model-name tiny --enable-metrics",
            id="sglang-plain-cpu-no-transfer-backend",
        ),
        pytest.param(
            topo("sim"),
            PREFILL,
            "py -m backends.sim --mode prefill --host 10.0.0.1 --port 30000 --bootstrap-port 8998 "
            "--model-path /m",
            id="sim-prefill",
        ),
        pytest.param(
            topo("sim", model_name="m1"),
            DECODE,
            "py -m backends.sim --mode decode --host 10.0.0.1 --port 30001 --model-path /m "
            "--served-model-name m1",
            id="sim-decode-model-name",
        ),
        pytest.param(
            topo("sim"),
            PLAIN,
            "py -m backends.sim --mode null --host 127.0.0.1 --port 30002 --model-path /m "
            "--enable-metrics",
            id="sim-plain-extra-args",
        ),
    ],
)
def test_argv(topology: Topology, server: ServerSpec, expected: str) -> None:
    assert build_command(topology, server).argv == tuple(shlex.split(expected))


def test_sim_runs_from_repo_root_unless_cwd_given(tmp_path: object) -> None:
    assert build_command(topo("sim"), PREFILL).cwd == REPO_ROOT
    assert build_command(topo("sglang"), PREFILL).cwd is None


def test_env_is_only_the_additions() -> None:
    server = ServerSpec("decode", 0, "127.0.0.1", 1, env=(("A", "1"), ("B", "x y")))
    command = build_command(topo(), server)
    assert command.env == (("A", "1"), ("B", "x y"))
    assert command.environ({"A": "0", "PATH": "/bin"}) == {"A": "1", "B": "x y", "PATH": "/bin"}


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        pytest.param(LaunchCommand(("py", "-m", "x")), "py -m x", id="plain"),
        pytest.param(
            LaunchCommand(("py", "a b"), (("K", "v w"),)), "env 'K=v w' py 'a b'", id="quoted"
        ),
        pytest.param(
            LaunchCommand(("py",), (), REPO_ROOT / "d d"),
            f"cd '{REPO_ROOT}/d d' && py",
            id="cwd",
        ),
    ],
)
def test_shell_line(command: LaunchCommand, expected: str) -> None:
    assert command.shell() == expected


def test_dry_run_text_names_each_server_then_its_command() -> None:
    topology = Topology(backend="sglang", servers=(PREFILL, DECODE), python="py", model_path="/m")
    lines = dry_run_text(topology).splitlines()
    assert lines[0] == "# prefill-0: http://10.0.0.1:30000 bootstrap 8998"
    assert lines[1].startswith("py -m sglang.launch_server ")
    assert lines[2] == "# decode-0: http://10.0.0.1:30001"
    assert len(lines) == 4
