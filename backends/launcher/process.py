"""One server's OS process: spawn it in its own process group, log its output, stop the group.

Why a process group per server: SGLang forks a scheduler, a detokenizer and a resource tracker;
signalling the whole group is the only way to be sure none of them outlives a stop. Why
PR_SET_PDEATHSIG: if the launcher itself is SIGKILLed, the kernel kills each server leader, and
SGLang's own children already die with their parent, so nothing is orphaned.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from backends.launcher.commands import LaunchCommand

PR_SET_PDEATHSIG = 1
READ_CHUNK = 65536
EXIT_POLL_S = 0.1  # how often `wait` looks for the leader's exit code


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGKILL it when the thread that spawned it dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group `pgid`, read from /proc.

    Zombies are skipped: orphaned grandchildren may linger as zombies when PID 1 does not reap,
    yet they hold no resources and cannot be killed.
    """
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != b"Z":
            members.append(int(entry.name))
    return members


def signal_group(pgid: int, sig: int) -> None:
    """Send `sig` to the group; a group that is already gone is not an error."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


class ServerProcess:
    """Spawns and stops one server; restartable (each spawn appends to the same log file)."""

    def __init__(
        self,
        name: str,
        command: LaunchCommand,
        log_path: Path,
        echo: Callable[[str], None] | None = None,
        die_with_parent: bool = True,
    ) -> None:
        self.name = name
        self.command = command
        self.log_path = log_path
        self._echo = echo
        self._die_with_parent = die_with_parent and sys.platform == "linux"
        self._proc: asyncio.subprocess.Process | None = None
        self._pump: asyncio.Task[None] | None = None
        self._log: BinaryIO | None = None
        self.spawn_count = 0

    @property
    def pid(self) -> int | None:
        """pid of the server's leader process (also its process group id), None before spawn."""
        return self._proc.pid if self._proc is not None else None

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    async def spawn(self) -> None:
        """Start the process in a new session (so a new process group) with output to the log."""
        self.spawn_count += 1
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self._log is None:
            self._log = open(self.log_path, "ab")  # closed by close_log()
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        header = (
            f"\n=== launcher: start #{self.spawn_count} at {stamp}\n=== {self.command.shell()}\n"
        )
        self._log.write(header.encode())
        self._log.flush()
        self._proc = await asyncio.create_subprocess_exec(
            *self.command.argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=self.command.environ(os.environ),
            cwd=self.command.cwd,
            start_new_session=True,
            preexec_fn=_die_with_parent if self._die_with_parent else None,
        )
        self._pump = asyncio.create_task(self._pump_output(self._proc), name=f"log-{self.name}")

    async def wait(self) -> int:
        """Wait for the leader to exit; returns its exit code (negative: killed by a signal).
        Its exit code is polled: on Python 3.11 `Process.wait()` also waits for the output
        pipe to close, which a child of the leader that outlived it holds (SGLang's scheduler
        and detokenizer), and a SIGKILLed leader was never seen to exit, never restarted."""
        proc = self._proc
        if proc is None:
            raise RuntimeError(f"{self.name} was never spawned")
        while proc.returncode is None:
            await asyncio.sleep(EXIT_POLL_S)
        return proc.returncode

    def group_alive(self) -> bool:
        return self.pid is not None and bool(group_members(self.pid))

    async def stop(self, grace_s: float) -> None:
        """SIGTERM the group, wait up to `grace_s`, then SIGKILL what is left; idempotent."""
        if self._proc is None:
            return
        pgid = self._proc.pid
        signal_group(pgid, signal.SIGTERM)
        signal_group(pgid, signal.SIGCONT)  # a stopped (SIGSTOP) server takes its SIGTERM now
        deadline = time.monotonic() + grace_s
        while group_members(pgid) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if group_members(pgid):
            signal_group(pgid, signal.SIGKILL)
            kill_deadline = time.monotonic() + 5.0
            while group_members(pgid) and time.monotonic() < kill_deadline:
                await asyncio.sleep(0.05)
        await self._proc.wait()
        await self._finish_pump()

    def kill_now(self, grace_s: float) -> None:
        """Blocking stop without an event loop, for atexit: TERM, short wait, KILL."""
        if self._proc is None:
            return
        pgid = self._proc.pid
        signal_group(pgid, signal.SIGTERM)
        signal_group(pgid, signal.SIGCONT)
        deadline = time.monotonic() + grace_s
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        signal_group(pgid, signal.SIGKILL)

    def close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    async def _finish_pump(self) -> None:
        """Let the pump drain what is buffered; don't wait on pipes held by stray processes."""
        if self._pump is None:
            return
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(self._pump), timeout=1.0)
        self._pump.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._pump

    async def _pump_output(self, proc: asyncio.subprocess.Process) -> None:
        """Copy output to the log file, and, if asked, to the console with a `[name]` prefix."""
        if proc.stdout is None:  # never: spawn() always asks for a pipe
            return
        pending = b""
        while chunk := await proc.stdout.read(READ_CHUNK):
            if self._log is not None:
                self._log.write(chunk)
                self._log.flush()
            if self._echo is not None:
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    self._echo(f"[{self.name}] {line.decode(errors='replace')}")
        if self._echo is not None and pending:
            self._echo(f"[{self.name}] {pending.decode(errors='replace')}")
