"""Start benchmark processes pinned to CPUs, wait until they answer, and always stop them.

Each process runs in its own session (process group), so stopping it also stops whatever it
started; its output goes to a log file, never to a pipe that could fill and block it. A run
stops itself at its `--timeout` (`stop_after`) and on SIGTERM, through the same exits.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Collection, Iterator
from pathlib import Path

from backends.launcher.ports import free_port as free_port  # the one port picker, re-exported

HOST = "127.0.0.1"
ROOT = Path(__file__).resolve().parents[1]


# Where taskset is missing: set the affinity, then become the command (same pid, so its
# children inherit the CPUs from their first instruction on).
_PIN = ("import os, sys; os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(',')}); "
        "os.execvp(sys.argv[2], sys.argv[2:])")


def pinned(argv: list[str], cpus: int | Collection[int] | None) -> list[str]:
    """`argv` run on the CPU or CPUs `cpus` (unchanged when None)."""
    if cpus is None:
        return argv
    spec = ",".join(str(c) for c in sorted({cpus} if isinstance(cpus, int) else set(cpus)))
    if shutil.which("taskset") is None:
        return [sys.executable, "-c", _PIN, spec, *argv]
    return ["taskset", "-c", spec, *argv]


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

    def wait_output(self, text: str, timeout: float) -> None:
        """Wait until `text` appears in the process's output; fail early if it dies."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.log_path.read_text(errors="replace"):
                return
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n"
                                   f"{self.tail()}")
            time.sleep(0.1)
        raise TimeoutError(f"{self.name} did not print {text!r} in {timeout}s:\n{self.tail()}")

    def stop(self, grace: float = 5.0) -> None:
        stop_group(self.popen, grace)
        self._log.close()


@contextlib.contextmanager
def running(name: str, argv: list[str], log_dir: Path, ready_url: str | None,
            timeout: float = 60.0, cwd: Path = ROOT, env: dict | None = None) -> Iterator[Proc]:
    proc = Proc(name, argv, log_dir, cwd, env)
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


class OutOfTime(Exception):
    """--timeout was reached."""


def _on_signal(signum, _frame):
    raise SystemExit(f"stopped by signal {signum}")


def _on_alarm(_signum, _frame):
    raise OutOfTime("benchmark exceeded --timeout; stopping")


def stop_after(seconds: float) -> None:
    """SIGTERM stops the run like Ctrl-C, and `seconds` from now OutOfTime is raised, both
    through the `running` exits, so every process started is stopped (`signal.alarm(0)`
    cancels the deadline)."""
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(max(1, int(seconds)))
