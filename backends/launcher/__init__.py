"""Start, supervise and stop SGLang (or simulated) prefill/decode servers.

    from backends.launcher import Launcher, load_topology
    launcher = Launcher(load_topology("topo.yaml"), on_state=callback)
    await launcher.start(); ...; await launcher.stop()

`BackgroundLauncher` offers the same with a blocking API (a loop in a thread) for sync callers.
"""

from backends.launcher.background import BackgroundLauncher
from backends.launcher.commands import LaunchCommand, build_command, dry_run_text
from backends.launcher.errors import LauncherError, StartupError, TopologyError
from backends.launcher.launcher import Launcher
from backends.launcher.loader import default_topology, load_topology, topology_from_dict
from backends.launcher.server import OnState, ServerHandle, ServerState
from backends.launcher.topology import RestartPolicy, Role, ServerSpec, Topology
from backends.launcher.validate import find_problems, validate

__all__ = [
    "BackgroundLauncher",
    "LaunchCommand",
    "Launcher",
    "LauncherError",
    "OnState",
    "RestartPolicy",
    "Role",
    "ServerHandle",
    "ServerSpec",
    "ServerState",
    "StartupError",
    "Topology",
    "TopologyError",
    "build_command",
    "default_topology",
    "dry_run_text",
    "find_problems",
    "load_topology",
    "topology_from_dict",
    "validate",
]
