"""`python -m backends.launcher`: start a topology, supervise it until SIGINT/SIGTERM.

Without --config it runs the no-GPU default: 1 prefill + 2 decode simulated servers on free
loopback ports. Exit codes: 0 stopped cleanly, 2 invalid topology, 3 servers failed to start.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from backends.launcher.commands import dry_run_text
from backends.launcher.errors import StartupError, TopologyError
from backends.launcher.launcher import Launcher
from backends.launcher.loader import default_topology, load_topology
from backends.launcher.server import ServerHandle, ServerState
from backends.launcher.topology import Topology
from backends.launcher.validate import validate

EXIT_OK, EXIT_TOPOLOGY, EXIT_STARTUP = 0, 2, 3


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m backends.launcher", description=__doc__)
    parser.add_argument("--config", type=Path, help="topology file (.yaml, .toml, .json)")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the commands (shell-quoted, with env) and exit",
    )
    parser.add_argument("--log-dir", type=Path, help="override the topology's log_dir")
    parser.add_argument(
        "--echo",
        action="store_true",
        help="also copy server output to stderr, prefixed with [name]",
    )
    parser.add_argument("--no-progress", action="store_true", help="no readiness display")
    parser.add_argument(
        "--state-file",
        type=Path,
        help="keep a JSON list of servers (role, url, bootstrap_port, state, "
        "pid, log) up to date in this file",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log state changes")
    return parser.parse_args(argv)


def read_topology(args: argparse.Namespace) -> Topology:
    topology = load_topology(args.config) if args.config else default_topology()
    if args.log_dir is not None:
        topology = dataclasses.replace(topology, log_dir=args.log_dir)
    return topology


def server_record(server: ServerHandle) -> dict[str, object]:
    """What the state file and the ready summary say about one server."""
    return {
        "name": server.name,
        "role": server.role,
        "url": server.url,
        "bootstrap_port": server.bootstrap_port,
        "state": server.state.value,
        "pid": server.pid,
        "log": str(server.log_path),
    }


class StateFile:
    """Rewrites the state file atomically on every state change, for tools that poll it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.servers: Sequence[ServerHandle] = ()

    def __call__(self, server: ServerHandle, state: ServerState) -> None:
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps([server_record(s) for s in self.servers], indent=2) + "\n")
        os.replace(tmp, self.path)


async def run(topology: Topology, args: argparse.Namespace) -> int:
    state_file = StateFile(args.state_file) if args.state_file else None
    started = False

    def on_state(server: ServerHandle, state: ServerState) -> None:
        if started and state is not ServerState.STOPPED:
            print(f"launcher: {server.name} {state.value}", file=sys.stderr, flush=True)
        if state_file is not None:
            state_file(server, state)

    launcher = Launcher(topology, on_state, echo=args.echo, progress=not args.no_progress)
    if state_file is not None:
        state_file.servers = launcher.servers
    try:
        await launcher.start()
    except StartupError as exc:
        print(f"launcher: {exc}", file=sys.stderr)
        return EXIT_STARTUP
    started = True
    for server in launcher.servers:
        record = server_record(server)
        boot = f" bootstrap={record['bootstrap_port']}" if server.bootstrap_port else ""
        print(
            f"{server.name:<10} {server.url}{boot} pid={server.pid} log={server.log_path}",
            flush=True,
        )
    await launcher.wait()
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        topology = read_topology(args)
        if args.dry_run:
            validate(topology, check_ports=False)
            sys.stdout.write(dry_run_text(topology))
            return EXIT_OK
        return asyncio.run(run(topology, args))
    except TopologyError as exc:
        print(f"launcher: {exc}", file=sys.stderr)
        return EXIT_TOPOLOGY
