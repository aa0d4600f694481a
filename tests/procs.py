"""Real processes on loopback for integration tests: free ports, start, wait, stop."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from backends.launcher.ports import free_port as free_port  # the one port picker, re-exported
from loadtests.launch import stop_group

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"


class Proc:
    """A child process in its own session, with its output in a log file."""

    def __init__(self, name: str, argv: list[str], log_dir: Path, env: dict | None = None):
        self.name = name
        self.argv = argv
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_http(self, url: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=1.0).status_code == 200:
                    return
            time.sleep(0.05)
        raise TimeoutError(f"{self.name} not ready at {url} after {timeout}s:\n{self.log()}")

    def stop(self, grace: float = 5.0) -> None:
        stop_group(self.popen, grace)
        self._log.close()


def python(*args: str) -> list[str]:
    return [sys.executable, *args]


@contextlib.contextmanager
def running(name: str, argv: list[str], log_dir: Path, ready_url: str | None,
            env: dict | None = None, timeout: float = 30.0) -> Iterator[Proc]:
    proc = Proc(name, argv, log_dir, env)
    try:
        if ready_url:
            proc.wait_http(ready_url, timeout)
        yield proc
    finally:
        proc.stop()
