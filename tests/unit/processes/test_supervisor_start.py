"""The supervisor's start and its workers' exits, in one process: which exit is fatal, and
what a failed start leaves behind (the real processes: tests/reliability/test_worker_start.py)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from gateway.config.settings import load_config
from gateway.processes import supervisor
from gateway.processes.supervisor import Supervisor

# reuseport: the supervisor binds no socket of its own, so no port is needed here
ARGV = ["--host", "127.0.0.1", "--port", "9", "--workers", "2", "--workers-socket", "reuseport",
        "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]


class Exited:
    """A finished worker process (what `_exited` is given)."""

    returncode = 3

    def poll(self) -> int:
        return self.returncode


class NoBlock:
    """The shared block's one call `_exited` makes."""

    def forget_worker(self, worker: int) -> None:
        pass


def made(monkeypatch: pytest.MonkeyPatch) -> Supervisor:
    sup = Supervisor(load_config(ARGV), ARGV)
    sup.shared = NoBlock()  # type: ignore[assignment]
    monkeypatch.setattr(sup.hub, "detach", lambda worker: None)
    return sup


def test_a_start_error_before_the_worker_served_is_fatal(monkeypatch):
    """Exit 3 (a start-up error) before "ready": restarting it looped forever (backoff up
    to 30 s, the same traceback each time); now no restart, and the gateway exits 3."""
    sup = made(monkeypatch)
    sup.procs = {0: Exited(), 1: Exited()}  # type: ignore[dict-item]
    assert sup._exited(0, 3) is None
    assert sup.exit_code == 3
    assert 0 not in sup.procs


def test_a_worker_that_served_is_restarted_whatever_its_exit(monkeypatch):
    """After it served once, an exit 3 (or any) is a crash: restarted with the backoff."""
    sup = made(monkeypatch)
    sup.procs = {0: Exited(), 1: Exited()}  # type: ignore[dict-item]
    sup._announce(0)
    assert sup._exited(0, 3) == 1.0
    assert sup._exited(1, -9) == 1.0  # a kill is never fatal, served or not
    assert sup.exit_code == 0


def test_a_failed_start_removes_its_directory(monkeypatch, tmp_path):
    """The shared block's creation fails (/dev/shm full, a stale name): the directory
    `mkdtemp` made (lock, metrics) stayed in /tmp, since the `try` began after it."""
    monkeypatch.setattr(supervisor.tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(supervisor.os, "environ", dict(os.environ))  # PROMETHEUS_MULTIPROC_DIR

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(supervisor, "SharedState", full)
    with pytest.raises(OSError):
        Supervisor(load_config(ARGV), ARGV).run()
    assert list(Path(tmp_path).iterdir()) == []


def test_each_start_names_its_block_anew(monkeypatch, tmp_path):
    """`pdgw-<pid>` was the same name at every start in a container (PID 1): a block left
    by a killed run made the next start fail with EEXIST."""
    monkeypatch.setattr(supervisor.tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(supervisor.os, "environ", dict(os.environ))
    names: list[str] = []

    def record(name: str, *args: object, **kwargs: object) -> None:
        names.append(name)
        raise OSError(errno.EEXIST, "File exists")

    monkeypatch.setattr(supervisor, "SharedState", record)
    for _ in range(2):
        with pytest.raises(OSError):
            Supervisor(load_config(ARGV), ARGV).run()
    assert len(set(names)) == 2, names
    assert all(name.startswith(f"pdgw-{os.getpid()}-") for name in names)
