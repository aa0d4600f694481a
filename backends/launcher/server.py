"""Runtime view of one launched server: what a gateway needs to put it into rotation or not."""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from pathlib import Path

from backends.launcher.commands import LaunchCommand
from backends.launcher.process import ServerProcess
from backends.launcher.topology import Role, ServerSpec


class ServerState(enum.StrEnum):
    """Lifecycle reported through `on_state`; only READY servers should receive traffic."""

    STARTING = "starting"
    READY = "ready"
    CRASHED = "crashed"
    RESTARTING = "restarting"
    STOPPED = "stopped"


class ServerHandle:
    """One server of a running topology; state and pid change as the launcher supervises it."""

    def __init__(self, spec: ServerSpec, process: ServerProcess) -> None:
        self.spec = spec
        self.process = process
        self.state = ServerState.STOPPED
        self.restarts = 0  # restarts done so far, over the launcher's lifetime
        self.gave_up = False  # max consecutive restarts exceeded; left crashed
        self.last_exit_code: int | None = None
        self.ready_since: float | None = None  # monotonic time of the last READY

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def role(self) -> Role:
        return self.spec.role

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def bootstrap_port(self) -> int | None:
        return self.spec.bootstrap_port

    @property
    def pid(self) -> int | None:
        """pid of the running leader process (its process group id); None when not running."""
        return self.process.pid if self.process.running else None

    @property
    def log_path(self) -> Path:
        return self.process.log_path

    @property
    def command(self) -> LaunchCommand:
        return self.process.command

    def __repr__(self) -> str:
        return (
            f"<ServerHandle {self.name} {self.url} state={self.state.value} "
            f"pid={self.pid} restarts={self.restarts}>"
        )


OnState = Callable[[ServerHandle, ServerState], "Awaitable[None] | None"]
"""Called on every state change; may be sync or async. Exceptions are logged, not raised."""
