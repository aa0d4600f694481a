"""The topology: which servers to run, how, and how to supervise them (frozen data, no I/O).

A `Topology` is fully expanded: every server has its host, ports and GPU ids, and its args and
env already include the role and global defaults. `loader.py` builds one from a short spec.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

Backend = Literal["sglang", "sim"]
Role = Literal["prefill", "decode", "plain"]
Device = Literal["cuda", "cpu"]

BACKENDS: tuple[Backend, ...] = ("sglang", "sim")
ROLES: tuple[Role, ...] = ("prefill", "decode", "plain")
DEVICES: tuple[Device, ...] = ("cuda", "cpu")
# Our role name -> the `--disaggregation-mode` (SGLang) / `--mode` (sim) value.
DISAGGREGATION_MODE: Mapping[Role, str] = {
    "prefill": "prefill",
    "decode": "decode",
    "plain": "null",
}
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class RestartPolicy:
    """Exponential backoff for crashed servers; the count resets after a stable period."""

    initial_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    max_restarts: int = 5
    stable_after_s: float = 60.0

    def backoff(self, attempt: int) -> float:
        """Delay before restart number `attempt` (1-based): initial, 2x, 4x, ... capped."""
        return min(self.initial_backoff_s * 2 ** max(attempt - 1, 0), self.max_backoff_s)


@dataclass(frozen=True)
class ServerSpec:
    """One server process. `env` holds only the variables added to the launcher's environment."""

    role: Role
    index: int
    host: str
    port: int
    bootstrap_port: int | None = None
    tp_size: int = 1
    base_gpu_id: int = 0
    ib_device: str | None = None
    transfer_backend: str = "mooncake"
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    model_path: str | None = None  # this server's model, else the topology's
    model_name: str | None = None
    # --enable-pd-role-switch: SGLang then runs a bootstrap server on every PD instance, so a
    # decode gets a bootstrap_port too (docs/LAUNCHER.md, "Role switch")
    pd_role_switch: bool = False

    @property
    def name(self) -> str:
        """Stable name used for log files and messages, e.g. `decode-1`."""
        return f"{self.role}-{self.index}"

    @property
    def url(self) -> str:
        """Base URL the gateway talks to (IPv6 hosts in brackets)."""
        return f"http://{url_host(self.host)}:{self.port}"

    @property
    def gpu_ids(self) -> range:
        """GPUs this server occupies: base_gpu_id .. base_gpu_id + tp_size - 1."""
        return range(self.base_gpu_id, self.base_gpu_id + self.tp_size)

    @property
    def env_dict(self) -> dict[str, str]:
        return dict(self.env)


@dataclass(frozen=True)
class Topology:
    """Everything the launcher needs; built by `loader.topology_from_dict` or by hand."""

    backend: Backend
    servers: tuple[ServerSpec, ...]
    python: str
    model_path: str | None = None
    model_name: str | None = None
    device: Device = "cuda"
    log_dir: Path = Path("logs/launcher")
    cwd: Path | None = None
    readiness_timeout_s: float = 300.0
    health_path: str = "/health"
    health_interval_s: float = 0.5
    stop_grace_s: float = 15.0
    restart: RestartPolicy = field(default_factory=RestartPolicy)

    def by_role(self, role: Role) -> tuple[ServerSpec, ...]:
        return tuple(server for server in self.servers if server.role == role)

    def model_path_of(self, server: ServerSpec) -> str | None:
        return server.model_path or self.model_path

    def model_name_of(self, server: ServerSpec) -> str | None:
        """The served model name the server is started with (None: the server's default)."""
        return server.model_name or self.model_name

    def server(self, name: str) -> ServerSpec:
        """The server called `name` (e.g. `prefill-0`); KeyError if there is none."""
        for server in self.servers:
            if server.name == name:
                return server
        raise KeyError(name)


def url_host(host: str) -> str:
    """Host as it appears in a URL: IPv6 literals need brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
