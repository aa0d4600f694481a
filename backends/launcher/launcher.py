"""Start, supervise and stop the servers of a topology (asyncio).

    launcher = Launcher(topology, on_state=callback)
    await launcher.start()      # validate, spawn all, wait until every /health is 200
    ...                         # crashed servers are restarted with backoff meanwhile
    await launcher.stop()       # SIGTERM each process group, then SIGKILL; idempotent

`on_state(server, state)` reports every transition (starting, ready, crashed, restarting,
stopped) so a gateway can put a server into rotation or take it out.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import inspect
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from backends.launcher.commands import build_command
from backends.launcher.errors import StartupError
from backends.launcher.heartbeat import restart_hold_s
from backends.launcher.process import ServerProcess
from backends.launcher.progress import show_progress
from backends.launcher.server import OnState, ServerHandle, ServerState
from backends.launcher.topology import Role, Topology
from backends.launcher.validate import validate

log = logging.getLogger("backends.launcher")
HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)
LOG_TAIL_LINES = 25


class Launcher:
    """Owns the server processes of one topology for the lifetime of start() .. stop()."""

    def __init__(
        self,
        topology: Topology,
        on_state: OnState | None = None,
        *,
        echo: bool = False,
        progress: bool = True,
        handle_signals: bool = True,
        check_ports: bool = True,
        die_with_parent: bool = True,
    ) -> None:
        self.topology = topology
        self._on_state = on_state
        self._progress = progress
        self._handle_signals = handle_signals
        self._check_ports = check_ports
        echo_fn: Callable[[str], None] | None = _echo_line if echo else None
        self.servers: tuple[ServerHandle, ...] = tuple(
            ServerHandle(
                spec,
                ServerProcess(
                    spec.name,
                    build_command(topology, spec),
                    topology.log_dir / f"{spec.name}.log",
                    echo_fn,
                    die_with_parent,
                ),
            )
            for spec in topology.servers
        )
        self._client: httpx.AsyncClient | None = None
        self._supervisors: list[asyncio.Task[None]] = []
        self._started = False
        self._stopping = False
        self._stop_task: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()
        self._signals_installed: dict[int, object] = {}

    def by_role(self, role: Role) -> list[ServerHandle]:
        return [server for server in self.servers if server.role == role]

    def server(self, name: str) -> ServerHandle:
        for server in self.servers:
            if server.name == name:
                return server
        raise KeyError(name)

    async def __aenter__(self) -> Launcher:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Validate, spawn every server, wait until all are ready, then supervise them.

        Raises `TopologyError` (nothing started) or `StartupError` (everything stopped again).
        """
        if self._started:
            raise RuntimeError("a Launcher starts once; create a new one to start again")
        self._started = True
        validate(self.topology, check_ports=self._check_ports)
        self.topology.log_dir.mkdir(parents=True, exist_ok=True)
        atexit.register(self._kill_at_exit)
        self._install_signal_handlers()
        self._client = httpx.AsyncClient(trust_env=False, timeout=5.0)
        try:
            for server in self.servers:
                await server.process.spawn()
                await self._set_state(server, ServerState.STARTING)
            await self._wait_all_ready()
        except BaseException:
            await self.stop()
            raise
        self._supervisors = [
            asyncio.create_task(self._supervise(server), name=f"supervise-{server.name}")
            for server in self.servers
        ]

    async def wait(self) -> None:
        """Block until stop() has finished (e.g. after SIGINT/SIGTERM)."""
        await self._stopped.wait()

    async def stop(self) -> None:
        """Stop every server (TERM, grace, KILL per process group); safe to call many times."""
        if self._stop_task is None:
            self._stop_task = asyncio.create_task(self._stop_all(), name="launcher-stop")
        await asyncio.shield(self._stop_task)

    async def _stop_all(self) -> None:
        self._stopping = True
        current = asyncio.current_task()
        for task in self._supervisors:
            if task is not current:
                task.cancel()
        await asyncio.gather(*self._supervisors, return_exceptions=True)
        grace = self.topology.stop_grace_s
        await asyncio.gather(*(server.process.stop(grace) for server in self.servers))
        for server in self.servers:
            server.process.close_log()
            if server.state is not ServerState.STOPPED:
                await self._set_state(server, ServerState.STOPPED)
        if self._client is not None:
            await self._client.aclose()
        self._remove_signal_handlers()
        atexit.unregister(self._kill_at_exit)
        self._stopped.set()

    async def _wait_all_ready(self) -> None:
        """Wait for every /health; fail fast on the first crash, or at the deadline."""
        deadline = time.monotonic() + self.topology.readiness_timeout_s
        progress = asyncio.create_task(show_progress(self.servers)) if self._progress else None
        waits = {asyncio.create_task(self._wait_ready(s, deadline)): s for s in self.servers}
        failed: ServerHandle | None = None
        try:
            while waits and failed is None:
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    server = waits.pop(task)
                    if task.result():
                        await self._set_state(server, ServerState.READY)
                    else:
                        failed = server
        finally:
            for task in waits:
                task.cancel()
            if progress is not None:
                progress.cancel()
                await asyncio.gather(progress, return_exceptions=True)
        if failed is not None:
            raise StartupError(self._failure_message(failed))

    def _failure_message(self, server: ServerHandle) -> str:
        if self._stopping:
            return "start interrupted: the launcher is stopping"
        code = server.process.returncode
        why = (
            f"exited with code {code}"
            if code is not None
            else f"not ready within {self.topology.readiness_timeout_s:.0f}s"
        )
        tail = _tail(server.log_path, LOG_TAIL_LINES)
        return f"{server.name} ({server.url}) {why}; log {server.log_path}:\n{tail}"

    async def _wait_ready(self, server: ServerHandle, deadline: float) -> bool:
        """Poll GET health_path until 200 (True), the process exits or the deadline (False)."""
        url = server.url + self.topology.health_path
        while not self._stopping and server.process.running:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._client is None:
                return False
            with contextlib.suppress(httpx.HTTPError):
                response = await self._client.get(url, timeout=min(5.0, remaining))
                if response.status_code == 200:
                    return True
            await asyncio.sleep(min(self.topology.health_interval_s, max(remaining, 0)))
        return False

    async def _supervise(self, server: ServerHandle) -> None:
        """Restart the server whenever it exits unexpectedly, until max restarts in a row."""
        policy = self.topology.restart
        consecutive = 0
        while not self._stopping:
            server.last_exit_code = await server.process.wait()
            if self._stopping:
                return
            if server.process.group_alive():
                # its leader died, its group did not (SGLang's scheduler and detokenizer are
                # its children): what survives holds the port, the GPU and answers /health,
                # so the restart failed on "address already in use" and read the orphan as
                # ready; stopped now, as `stop` would
                log.warning("%s: its leader exited; stopping the rest of its process group",
                            server.name)
                await server.process.stop(self.topology.stop_grace_s)
            stable = (
                server.ready_since is not None
                and time.monotonic() - server.ready_since >= policy.stable_after_s
            )
            consecutive = 1 if stable else consecutive + 1
            server.ready_since = None
            log.warning(
                "%s exited with code %s (log %s)",
                server.name,
                server.last_exit_code,
                server.log_path,
            )
            await self._set_state(server, ServerState.CRASHED)
            if consecutive > policy.max_restarts:
                server.gave_up = True
                log.error(
                    "%s: giving up after %d restarts in a row", server.name, policy.max_restarts
                )
                return
            await self._set_state(server, ServerState.RESTARTING)
            await asyncio.sleep(self._restart_delay(server, policy.backoff(consecutive)))
            if self._stopping:
                return
            server.restarts += 1
            await server.process.spawn()
            await self._set_state(server, ServerState.STARTING)
            deadline = time.monotonic() + self.topology.readiness_timeout_s
            if await self._wait_ready(server, deadline):
                await self._set_state(server, ServerState.READY)
            elif server.process.running and not self._stopping:
                log.warning("%s not ready in time after restart; stopping it", server.name)
                await server.process.stop(self.topology.stop_grace_s)

    def _restart_delay(self, server: ServerHandle, backoff: float) -> float:
        """The backoff, or longer while a decode could still hold the dead process's
        endpoints (heartbeat.py says why)."""
        hold = restart_hold_s(self.topology, server.spec, os.environ)
        if hold > backoff:
            log.info("%s: restart held %.0f s, until every decode has forgotten the dead "
                     "process (SGLang heartbeat)", server.name, hold)
        return max(backoff, hold)

    async def _set_state(self, server: ServerHandle, state: ServerState) -> None:
        server.state = state
        if state is ServerState.READY:
            server.ready_since = time.monotonic()
        log.info("%s %s (%s, pid %s)", server.name, state.value, server.url, server.pid)
        if self._on_state is None:
            return
        try:
            result = self._on_state(server, state)
            if inspect.isawaitable(result):
                await result
        except Exception:
            log.exception("on_state callback failed for %s -> %s", server.name, state.value)

    def _install_signal_handlers(self) -> None:
        """SIGINT/SIGTERM stop the servers; only possible from the main thread."""
        if not self._handle_signals or threading.current_thread() is not threading.main_thread():
            return
        loop = asyncio.get_running_loop()
        for sig in HANDLED_SIGNALS:
            self._signals_installed[sig] = signal.getsignal(sig)
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _remove_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig, previous in self._signals_installed.items():
            loop.remove_signal_handler(sig)
            if previous is not None:  # None: the handler was not set from Python
                signal.signal(sig, previous)  # type: ignore[arg-type]
        self._signals_installed.clear()

    def _on_signal(self, sig: int) -> None:
        log.warning("received %s: stopping all servers", signal.Signals(sig).name)
        if self._stop_task is None:
            self._stop_task = asyncio.get_running_loop().create_task(self._stop_all())

    def _kill_at_exit(self) -> None:
        """Last resort when the interpreter exits without stop(): kill every process group."""
        for server in self.servers:
            server.process.kill_now(grace_s=min(self.topology.stop_grace_s, 5.0))


def _echo_line(line: str) -> None:
    sys.stderr.write(line + "\n")


def _tail(path: Path, lines: int) -> str:
    try:
        with open(path, "rb") as handle:
            text = handle.read()[-16384:].decode(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])
