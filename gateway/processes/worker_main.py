"""One worker process of `--workers N` (started by gateway/processes/supervisor.py, not by hand).

    python -m gateway.processes.worker_main --worker-id I --workers N --control-fd FD --shared NAME
                                  --workdir DIR [--listen-fd FD] -- <the gateway's own flags>

It parses the gateway's flags exactly as the supervisor did, attaches the shared block and the
control channel, and serves the inherited listening socket (or, without `--listen-fd`, its own
SO_REUSEPORT socket) with the same uvicorn setup as a single gateway.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from dataclasses import dataclass

from gateway.cli import serve
from gateway.config.settings import EXIT_CONFIG_ERROR, ConfigError, load_config
from gateway.processes.control_channel import Control
from gateway.processes.shared_state import SharedState
from gateway.processes.supervisor import bound_socket


@dataclass
class WorkerContext:
    """What a worker knows of its siblings."""

    id: int
    count: int
    shared: SharedState
    control: Control


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    own = argparse.ArgumentParser(prog="python -m gateway.processes.worker_main")
    own.add_argument("--worker-id", type=int, required=True)
    own.add_argument("--workers", type=int, required=True)
    own.add_argument("--control-fd", type=int, required=True)
    own.add_argument("--listen-fd", type=int)
    own.add_argument("--shared", required=True)
    own.add_argument("--workdir", required=True)
    args = own.parse_args(argv[:split])
    try:
        config = load_config(argv[split + 1:])
    except (ConfigError, ValueError) as exc:
        print(f"gateway worker {args.worker_id}: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    shared = SharedState(args.shared, args.workers, len(config.api_keys),
                         os.path.join(args.workdir, "lock"))
    control = Control(socket.socket(fileno=args.control_fd), args.worker_id, args.workers)
    if args.listen_fd is not None:
        sock = socket.socket(fileno=args.listen_fd)
    else:
        sock = bound_socket(config, reuse_port=True)
    try:
        return serve(config, sockets=[sock],
                     worker=WorkerContext(args.worker_id, args.workers, shared, control))
    finally:
        shared.close()


if __name__ == "__main__":
    sys.exit(main())
