"""Check a topology before anything starts: every problem is collected and reported together.

Starting half a topology and failing on the third server wastes minutes (SGLang takes ~30 s to
import) and leaves a mess to clean up; these checks are cheap and catch the usual mistakes.
"""

from __future__ import annotations

import os
import shutil
from itertools import combinations

from backends.launcher.errors import TopologyError
from backends.launcher.ports import WILDCARDS, is_local, is_port_free
from backends.launcher.topology import ServerSpec, Topology


def validate(topology: Topology, check_ports: bool = True) -> None:
    """Raise `TopologyError` listing every problem; `check_ports` also binds each port once."""
    problems = find_problems(topology, check_ports)
    if problems:
        raise TopologyError(problems)


def find_problems(topology: Topology, check_ports: bool = True) -> list[str]:
    """All problems of the topology, in a stable order; empty when it can be started."""
    problems = _shape_problems(topology)
    for server in topology.servers:
        problems += _server_problems(server)
    problems += _endpoint_clashes(topology.servers)
    if topology.backend == "sglang" and topology.device == "cuda":
        problems += _gpu_overlaps(topology.servers)
    if topology.backend == "sglang":
        problems += _model_problems(topology)
    problems += _python_problems(topology.python)
    if check_ports and not problems:
        problems += _ports_in_use(topology.servers)
    return problems


def _shape_problems(topology: Topology) -> list[str]:
    problems = []
    if not topology.servers:
        problems.append("no servers: give at least one prefill and one decode (or plain)")
    groups = _by_model(topology)
    for model, servers in groups.items():
        prefill = [s for s in servers if s.role == "prefill"]
        decode = [s for s in servers if s.role == "decode"]
        if bool(prefill) != bool(decode):
            of_model = f"model {model}: " if len(groups) > 1 else ""
            problems.append(f"{of_model}PD needs both roles: {len(prefill)} prefill and "
                            f"{len(decode)} decode")
    if topology.readiness_timeout_s <= 0:
        problems.append("readiness_timeout_s must be > 0")
    if not topology.health_path.startswith("/"):
        problems.append(f"health_path must start with '/' (got {topology.health_path!r})")
    restart = topology.restart
    if restart.max_restarts < 0 or restart.initial_backoff_s < 0:
        problems.append("restart: max_restarts and initial_backoff_s must be >= 0")
    if restart.max_backoff_s < restart.initial_backoff_s:
        problems.append("restart: max_backoff_s must be >= initial_backoff_s")
    return problems


def _server_problems(server: ServerSpec) -> list[str]:
    name = server.name
    problems = []
    if not 1 <= server.port <= 65535:
        problems.append(f"{name}: port {server.port} is not in 1..65535")
    if server.role == "prefill":
        if server.bootstrap_port is None:
            problems.append(f"{name}: prefill servers need a bootstrap_port")
        elif not 1 <= server.bootstrap_port <= 65535:
            problems.append(f"{name}: bootstrap_port {server.bootstrap_port} is not in 1..65535")
    elif server.pd_role_switch:
        if server.bootstrap_port is None:  # start_disagg_service binds one on every instance
            problems.append(f"{name}: a server with enable_pd_role_switch needs a "
                            "bootstrap_port (SGLang runs a bootstrap server on it)")
    elif server.bootstrap_port is not None:
        problems.append(f"{name}: bootstrap_port applies to prefill servers only")
    if server.tp_size < 1:
        problems.append(f"{name}: tp_size must be >= 1 (got {server.tp_size})")
    if server.base_gpu_id < 0:
        problems.append(f"{name}: base_gpu_id must be >= 0 (got {server.base_gpu_id})")
    if not is_local(server.host):
        problems.append(
            f"{name}: host {server.host!r} is not an address of this machine "
            "(the launcher starts every server here)"
        )
    return problems


def _hosts_overlap(a: str, b: str) -> bool:
    return a == b or a in WILDCARDS or b in WILDCARDS


def _endpoint_clashes(servers: tuple[ServerSpec, ...]) -> list[str]:
    """Two listeners on one host:port, including bootstrap ports; named precisely."""
    listeners = [(s, "port", s.port) for s in servers]
    listeners += [
        (s, "bootstrap_port", s.bootstrap_port) for s in servers if s.bootstrap_port is not None
    ]
    problems = []
    for (a, a_kind, a_port), (b, b_kind, b_port) in combinations(listeners, 2):
        if a_port != b_port or not _hosts_overlap(a.host, b.host):
            continue
        if a_kind == b_kind == "bootstrap_port":
            problems.append(
                f"{a.name} and {b.name}: two prefills on host {a.host} share "
                f"bootstrap port {a_port}; give each its own bootstrap_port"
            )
        else:
            problems.append(f"duplicate {a.host}:{a_port}: {a.name} {a_kind} and {b.name} {b_kind}")
    return problems


def _gpu_overlaps(servers: tuple[ServerSpec, ...]) -> list[str]:
    """All servers run on this machine, so any two sharing a GPU id clash."""
    problems = []
    for a, b in combinations(servers, 2):
        shared = sorted(set(a.gpu_ids) & set(b.gpu_ids))
        if shared:
            problems.append(
                f"{a.name} (GPUs {_span(a)}) and {b.name} (GPUs {_span(b)}) overlap on "
                f"GPU {', '.join(map(str, shared))} of this machine"
            )
    return problems


def _span(server: ServerSpec) -> str:
    ids = server.gpu_ids
    return str(ids.start) if len(ids) == 1 else f"{ids.start}-{ids.stop - 1}"


def _by_model(topology: Topology) -> dict[str | None, list[ServerSpec]]:
    """Servers by the model they serve (its name, else its path): each model is its own PD
    cluster, so each needs both roles."""
    groups: dict[str | None, list[ServerSpec]] = {}
    for server in topology.servers:
        key = topology.model_name_of(server) or topology.model_path_of(server)
        groups.setdefault(key, []).append(server)
    return groups


def _model_problems(topology: Topology) -> list[str]:
    problems = []
    paths = dict.fromkeys(topology.model_path_of(s) for s in topology.servers)
    for path in paths or [topology.model_path]:
        if not path:
            problems.append("model_path: required for the sglang backend")
        # "org/name" is a hub id (SGLang downloads it); anything path-like must exist here.
        elif path.startswith(("/", ".", "~")) and not os.path.exists(os.path.expanduser(path)):
            problems.append(f"model_path: {path} does not exist")
    return problems


def _python_problems(python: str) -> list[str]:
    if os.sep in python:
        if not os.access(python, os.X_OK):
            return [f"python: {python} is not an executable file (build the rig first?)"]
    elif shutil.which(python) is None:
        return [f"python: {python!r} is not on PATH"]
    return []


def _ports_in_use(servers: tuple[ServerSpec, ...]) -> list[str]:
    problems = []
    for server in servers:
        for kind, port in (("port", server.port), ("bootstrap_port", server.bootstrap_port)):
            if port is not None and not is_port_free(server.host, port):
                problems.append(f"{server.name}: {kind} {server.host}:{port} is already in use")
    return problems
