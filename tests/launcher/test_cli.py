"""The CLI: dry-run output, exit codes, and no orphans when the launcher process is signalled."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from backends.launcher.cli import main
from tests.launcher.conftest import STANDIN_DIR, assert_gone, pid_alive, wait_until

REPO = Path(__file__).resolve().parents[2]


def test_dry_run_default_is_one_prefill_two_decode_sims(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    commands = [line for line in lines if not line.startswith("#")]
    assert len(commands) == 3
    assert "-m backends.sim --mode prefill --host 127.0.0.1 --port " in commands[0]
    assert "--bootstrap-port" in commands[0]
    assert all("--mode decode" in line for line in commands[1:])


def test_dry_run_prints_env_and_quoted_args(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "t.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "backend": "sglang",
                "model_path": str(tmp_path),
                "python": sys.executable,
                "base_port": 30000,
                "bootstrap_base_port": 8998,
                "prefill": 1,
                "decode": [{"args": ["--json-arg", '{"a": 1}'], "env": {"K": "v w"}}],
            }
        )
    )
    assert main(["--config", str(config), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "# prefill-0: http://127.0.0.1:30000 bootstrap 8998" in out
    assert f"env 'K=v w' {sys.executable} -m sglang.launch_server" in out
    assert "--json-arg '{\"a\": 1}'" in out


def test_invalid_topology_exits_2_and_lists_problems(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "t.yaml"
    config.write_text("backend: sglang\nmodel_path: /no/model\nprefill: 1\n")
    assert main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "model_path: /no/model does not exist" in err
    assert "PD needs both roles: 1 prefill and 0 decode" in err


def start_cli(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen[bytes], list[dict]]:
    """Run the CLI on a stand-in topology; return it once the state file says all are ready."""
    config = tmp_path / "t.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "backend": "sim",
                "cwd": str(STANDIN_DIR),
                "log_dir": str(tmp_path / "logs"),
                "prefill": 1,
                "decode": 2,
                "stop_grace_s": 3,
            }
        )
    )
    state = tmp_path / "state.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "backends.launcher",
            "--config",
            str(config),
            "--state-file",
            str(state),
            "--no-progress",
            *extra,
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )

    def all_ready() -> bool:
        try:
            servers = json.loads(state.read_text())
        except (OSError, ValueError):
            return False
        return all(s["state"] == "ready" for s in servers)

    assert wait_until(all_ready, timeout=30), proc.stderr
    return proc, json.loads(state.read_text())


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_signal_to_cli_stops_every_server(tmp_path: Path, sig: signal.Signals) -> None:
    proc, servers = start_cli(tmp_path)
    pgids = [s["pid"] for s in servers]
    assert all(pid_alive(pid) for pid in pgids)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err.decode()
    assert_gone(pgids)
    final = json.loads((tmp_path / "state.json").read_text())
    assert {s["state"] for s in final} == {"stopped"}


def test_sigkill_to_cli_takes_servers_down_via_pdeathsig(tmp_path: Path) -> None:
    proc, servers = start_cli(tmp_path)
    pgids = [s["pid"] for s in servers]
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=10)
    assert_gone(pgids)
