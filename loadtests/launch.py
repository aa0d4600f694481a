"""Start benchmark processes pinned to a CPU, wait until they answer, and always stop them.

Each process runs in its own session (process group), so stopping it also stops whatever it
started; its output goes to a log file, never to a pipe that could fill and block it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

HOST = "127.0.0.1"
ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def pinned(argv: list[str], cpu: int | None) -> list[str]:
    """`argv` run under `taskset -c cpu` (unchanged when cpu is None or taskset is missing)."""
    if cpu is None or shutil.which("taskset") is None:
        return argv
    return ["taskset", "-c", str(cpu), *argv]


class Proc:
    def __init__(self, name: str, argv: list[str], log_dir: Path, cwd: Path = ROOT,
                 env: dict | None = None) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            cwd=cwd, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def tail(self, lines: int = 20) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def wait_ready(self, url: str, timeout: float) -> None:
        """Poll `url` until it answers 200; fail early if the process dies."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n"
                                   f"{self.tail()}")
            with contextlib.suppress(OSError, urllib.error.URLError):
                with urllib.request.urlopen(url, timeout=1.0) as response:
                    if response.status == 200:
                        return
            time.sleep(0.1)
        raise TimeoutError(f"{self.name} not ready at {url} after {timeout}s:\n{self.tail()}")

    def stop(self, grace: float = 5.0) -> None:
        stop_group(self.popen, grace)
        self._log.close()


@contextlib.contextmanager
def running(name: str, argv: list[str], log_dir: Path, ready_url: str | None,
            timeout: float = 60.0, cwd: Path = ROOT) -> Iterator[Proc]:
    proc = Proc(name, argv, log_dir, cwd)
    try:
        if ready_url is not None:
            proc.wait_ready(ready_url, timeout)
        yield proc
    finally:
        proc.stop()


def stop_group(popen: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM a child's process group, SIGKILL it after `grace`; a dead leader's group may
    still hold children, so it is killed too."""
    if popen.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(popen.pid, signal.SIGTERM)
        try:
            popen.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(popen.pid, signal.SIGKILL)
            popen.wait(5)
    else:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(popen.pid, signal.SIGKILL)
