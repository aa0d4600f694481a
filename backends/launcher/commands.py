"""Turn one `ServerSpec` into the exact command line that starts it (pure, no I/O).

SGLang servers get the `python -m sglang.launch_server ...` line of SGLang's PD docs; simulated
servers get `python -m backends.sim ...`. One builder per backend, chosen from `BUILDERS`.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from backends.launcher.topology import DISAGGREGATION_MODE, Backend, ServerSpec, Topology

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class LaunchCommand:
    """argv plus the variables added to the launcher's environment, and the working directory."""

    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    cwd: Path | None = None

    def environ(self, base: Mapping[str, str]) -> dict[str, str]:
        """The child's full environment: `base` with this command's variables on top."""
        return {**base, **dict(self.env)}

    def shell(self) -> str:
        """One copy-pasteable shell line: `cd DIR && env A=1 python -m ...`."""
        parts = []
        if self.cwd is not None:
            parts.append(f"cd {shlex.quote(str(self.cwd))} &&")
        if self.env:
            parts.append("env " + " ".join(shlex.quote(f"{k}={v}") for k, v in self.env))
        parts.append(shlex.join(self.argv))
        return " ".join(parts)


def sglang_command(topology: Topology, server: ServerSpec) -> LaunchCommand:
    """`python -m sglang.launch_server --model-path M --disaggregation-mode ROLE ...extra`."""
    argv = [
        topology.python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        topology.model_path_of(server) or "",
        "--disaggregation-mode",
        DISAGGREGATION_MODE[server.role],
        "--host",
        server.host,
        "--port",
        str(server.port),
        "--tp-size",
        str(server.tp_size),
        "--base-gpu-id",
        str(server.base_gpu_id),
    ]
    if server.bootstrap_port is not None and (server.role == "prefill" or server.pd_role_switch):
        argv += ["--disaggregation-bootstrap-port", str(server.bootstrap_port)]
    if server.pd_role_switch:
        argv.append("--enable-pd-role-switch")
    if server.ib_device:
        argv += ["--disaggregation-ib-device", server.ib_device]
    if server.role != "plain":
        argv += ["--disaggregation-transfer-backend", server.transfer_backend]
    if topology.device != "cuda":
        argv += ["--device", topology.device]
    if topology.model_name_of(server):
        argv += ["--served-model-name", topology.model_name_of(server)]
    return LaunchCommand(tuple(argv + list(server.args)), server.env, topology.cwd)


def sim_command(topology: Topology, server: ServerSpec) -> LaunchCommand:
    """`python -m backends.sim --mode ROLE --host H --port P [--bootstrap-port B] ...extra`.

    Runs from the repository root (unless `cwd` is set) so `backends.sim` is importable.
    """
    argv = [
        topology.python,
        "-m",
        "backends.sim",
        "--mode",
        DISAGGREGATION_MODE[server.role],
        "--host",
        server.host,
        "--port",
        str(server.port),
    ]
    if server.bootstrap_port is not None and (server.role == "prefill" or server.pd_role_switch):
        argv += ["--bootstrap-port", str(server.bootstrap_port)]
    if server.pd_role_switch:
        argv.append("--enable-pd-role-switch")
    # as SGLang's flags: the served name defaults to the model path
    if topology.model_path_of(server):
        argv += ["--model-path", topology.model_path_of(server)]
    if topology.model_name_of(server):
        argv += ["--served-model-name", topology.model_name_of(server)]
    return LaunchCommand(tuple(argv + list(server.args)), server.env, topology.cwd or REPO_ROOT)


BUILDERS: Mapping[Backend, Callable[[Topology, ServerSpec], LaunchCommand]] = {
    "sglang": sglang_command,
    "sim": sim_command,
}


def build_command(topology: Topology, server: ServerSpec) -> LaunchCommand:
    """The command for `server` under the topology's backend."""
    return BUILDERS[topology.backend](topology, server)


def dry_run_text(topology: Topology) -> str:
    """What `--dry-run` prints: one commented, shell-quoted line per server."""
    lines = []
    for server in topology.servers:
        boot = f" bootstrap {server.bootstrap_port}" if server.bootstrap_port else ""
        lines.append(f"# {server.name}: {server.url}{boot}")
        lines.append(build_command(topology, server).shell())
    return "\n".join(lines) + "\n"
