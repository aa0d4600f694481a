"""Start simulated SGLang servers as real processes on 127.0.0.1 for tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from backends.launcher.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"


class Sim:
    """One `python -m backends.sim` child, stopped by `stop()`."""

    def __init__(self, mode: str, *flags: str, fast: bool = True, wait: str = "/server_info",
                 timeout: float = 15.0) -> None:
        self.mode = mode
        self.port = free_port()
        self.bootstrap_port = free_port() if mode == "prefill" else None
        argv = [sys.executable, "-m", "backends.sim", "--mode", mode, "--host", HOST,
                "--port", str(self.port)]
        if self.bootstrap_port is not None:
            argv += ["--bootstrap-port", str(self.bootstrap_port)]
        if fast:
            argv.append("--fast")
        argv += list(flags)
        self._log = tempfile.NamedTemporaryFile(prefix=f"sim-{mode}-", suffix=".log", delete=False)
        self.popen = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT,
                                      env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                      start_new_session=True)
        try:
            self._wait(wait, timeout)
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def pd_fields(self, room: int | list[int]) -> dict[str, Any]:
        """The bootstrap fields a router adds for this prefill server."""
        return {"bootstrap_host": HOST, "bootstrap_port": self.bootstrap_port, "bootstrap_room": room}

    def room_state(self, room: int) -> str:
        """State of a room on this prefill's bootstrap server ("unknown" if never seen)."""
        r = httpx.get(f"http://{HOST}:{self.bootstrap_port}/sim/rooms/{room}", timeout=5.0)
        return str(r.json().get("state"))

    def log(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def _wait(self, path: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"sim exited with {self.popen.returncode}:\n{self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + path, timeout=1.0).status_code == 200:
                    return
            time.sleep(0.05)
        raise TimeoutError(f"sim not ready after {timeout}s:\n{self.log()}")

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.get(self.url + path, timeout=kw.pop("timeout", 10.0), **kw)

    def post(self, path: str, json: Any = None, **kw: Any) -> httpx.Response:
        return httpx.post(self.url + path, json=json, timeout=kw.pop("timeout", 10.0), **kw)

    def stats(self) -> dict[str, Any]:
        return self.get("/sim/stats").json()

    def stop(self) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(5)
        self._log.close()
        with contextlib.suppress(OSError):
            os.unlink(self._log.name)


def wait_until(predicate: Any, timeout: float = 5.0, interval: float = 0.05) -> Any:
    """Poll `predicate` until it returns a truthy value (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)
