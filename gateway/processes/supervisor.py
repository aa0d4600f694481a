"""`--workers N`: N serving processes on one port, supervised (docs/WORKERS.md).

The supervisor binds the listening socket once and starts N worker processes
(`python -m gateway.processes.worker_main`), each a whole gateway serving that socket (with
`--workers-socket reuseport` each worker binds its own SO_REUSEPORT socket instead). It owns
what the workers share: the shared-memory block (gateway/processes/shared_state.py), the directory of
prometheus_client's multiprocess metrics, and the hub of the control channel
(gateway/processes/control_channel.py), and with `--launch` the local cluster (started once, before the workers,
which are given its servers as `--prefill`/`--decode`). A worker that exits unexpectedly is
started again (backoff 1 s doubling to 30 s, reset after a minute of service), unless it
failed its start (exit 2 or 3 before it ever served: the configuration cannot start, so the
supervisor stops the others and exits with that code, as one process would); SIGTERM or
SIGINT stops every worker gracefully (each finishes its requests within --shutdown-grace),
then the cluster, then the supervisor cleans up and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from gateway.config.settings import EXIT_CONFIG_ERROR, EXIT_STARTUP_FAILURE, GatewayConfig
from gateway.processes.control_channel import Hub
from gateway.processes.shared_state import SharedState

RESTART_BACKOFF = (1.0, 30.0)
PR_SET_PDEATHSIG = 1  # prctl(2)
# a worker's exit codes that mean "this configuration cannot start" (gateway/cli.py): fatal
# before the worker ever served, since every restart fails the same way
FATAL_BEFORE_READY = (EXIT_CONFIG_ERROR, EXIT_STARTUP_FAILURE)


def worker_count(setting: int | str) -> int:
    """`auto`: the cores this process may run on."""
    if setting == "auto":  # at most 32: the worker id has 5 bits in every room
        return max(1, min(32, len(os.sched_getaffinity(0))))
    return int(setting)


def bound_socket(config: GatewayConfig, reuse_port: bool = False) -> socket.socket:
    """The gateway's port, bound (a port taken fails the start at once) but not listening:
    the serving process listens once it can answer (`cli.GatewayServer.startup`), so until
    then, a local cluster's start included, connections are refused rather than left
    unanswered in the backlog."""
    host = config.host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, config.port))
    return sock


def die_with_parent() -> None:
    """Runs in a worker before exec: SIGTERM it (a graceful stop) when the supervisor dies,
    so that no worker outlives it, holding the port and serving a stale server set."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class Supervisor:
    def __init__(self, config: GatewayConfig, argv: list[str]) -> None:
        self.config = config
        self.argv = argv
        self.count = worker_count(config.workers)
        self.procs: dict[int, subprocess.Popen] = {}
        self.backoff: dict[int, float] = {}
        self.spawned: dict[int, float] = {}
        self.hub = Hub(self._announce)
        self._announced = False
        self.served: set[int] = set()  # workers that said "ready" once (hub.ready forgets)
        self.exit_code = 0
        self.stopping = False
        self.started_at = time.monotonic()

    def run(self) -> int:
        c = self.config
        # the port first: taken, the start fails with nothing made yet to clean up
        self.sock = None if c.workers_socket == "reuseport" else bound_socket(c)
        workdir = tempfile.mkdtemp(prefix="pd-gateway-")
        shared: SharedState | None = None
        try:  # from the directory on: a start that fails below removes it
            metrics_dir = os.path.join(workdir, "metrics")
            os.mkdir(metrics_dir)
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # inherited by the workers
            # unique per start, not per pid: in a container the supervisor is always PID 1,
            # and a kill of the whole group leaves the block behind (its resource tracker
            # dies too), so `pdgw-1` of the last run made the next start fail (EEXIST)
            name = f"pdgw-{os.getpid()}-{secrets.token_hex(4)}"
            shared = self.shared = SharedState(name, self.count, len(c.api_keys),
                                               os.path.join(workdir, "lock"), create=True)
            return asyncio.run(self._main(name, workdir))
        finally:
            if self.sock is not None:
                self.sock.close()
            if shared is not None:
                shared.close(unlink=True)
            shutil.rmtree(workdir, ignore_errors=True)

    async def _launch(self):
        """With --launch: start the cluster here, once; the workers serve its servers."""
        from backends.launcher import Launcher  # noqa: PLC0415 - only with --launch
        from gateway.launch import topology_of  # noqa: PLC0415

        launcher = Launcher(topology_of(self.config), handle_signals=False)
        await launcher.start()
        extra = ["--no-launch"]
        for server in launcher.servers:
            if server.role == "prefill":
                extra += ["--prefill", server.url, str(server.bootstrap_port or "none")]
            else:
                extra += ["--decode", server.url]
        self.argv = [*self.argv, *extra]
        return launcher

    def _announce(self, worker: int) -> None:
        """One line once every worker serves (what tests and scripts wait for)."""
        self.served.add(worker)
        if not self._announced and len(self.hub.ready) == self.count:
            self._announced = True
            print(f"gateway: {self.count} workers serving "
                  f"http{'s' if self.config.ssl_certfile else ''}://{self.config.host}:"
                  f"{self.config.port} ({self.config.workers_socket} socket)",
                  file=sys.stderr, flush=True)

    async def _main(self, name: str, workdir: str) -> int:
        loop = asyncio.get_running_loop()
        done = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, done.set)
        launcher = None
        if self.config.launch:  # SIGTERM while the cluster starts stops it (up to 300 s)
            launching = loop.create_task(self._launch())
            stopped = loop.create_task(done.wait())
            await asyncio.wait({launching, stopped}, return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            if not launching.done():
                launching.cancel()  # the launcher stops what it started
                await asyncio.gather(launching, return_exceptions=True)
                return 0
            launcher = launching.result()
        for worker in range(self.count):
            await self._spawn(worker, name, workdir)
        restarts: set[asyncio.Task] = set()
        while not done.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), 0.25)
            for worker, proc in list(self.procs.items()):
                if proc.poll() is not None and not done.is_set():
                    delay = self._exited(worker, proc.returncode)
                    if delay is None:  # it cannot start: neither can the others
                        done.set()
                        break
                    task = loop.create_task(self._restart(worker, name, workdir, delay))
                    restarts.add(task)
                    task.add_done_callback(restarts.discard)
        self.stopping = True
        for task in list(restarts):  # a worker waiting out its backoff is not started again
            task.cancel()
        if self.sock is not None:  # the port closes with the workers' copies: while this one
            self.sock.close()  # stayed, new clients queued on it unserved, then were reset
        await self._stop_all()
        if launcher is not None:
            await launcher.stop()
        return self.exit_code

    async def _spawn(self, worker: int, name: str, workdir: str) -> None:
        ours, theirs = socket.socketpair()
        fds = [theirs.fileno()]
        argv = [sys.executable, "-m", "gateway.processes.worker_main", "--worker-id", str(worker),
                "--workers", str(self.count), "--control-fd", str(theirs.fileno()),
                "--shared", name, "--workdir", workdir]
        if self.sock is not None:
            fds.append(self.sock.fileno())
            argv += ["--listen-fd", str(self.sock.fileno())]
        self.procs[worker] = subprocess.Popen(argv + ["--", *self.argv], pass_fds=fds,
                                              preexec_fn=die_with_parent)
        self.spawned[worker] = time.monotonic()
        theirs.close()
        await self.hub.attach(worker, ours)

    def _exited(self, worker: int, code: int) -> float | None:
        """`worker` exited: out of the hub and the shared block's figures; the seconds to
        wait before starting it again, or None when its start failed for good (exit 2 or 3
        before it ever served): restarting it looped forever, backoff capped at 30 s, with
        the pod Running and never ready instead of the start-up error's exit."""
        self.hub.detach(worker)
        self.shared.forget_worker(worker)  # its slots, legs and waiter died with it
        del self.procs[worker]
        if code in FATAL_BEFORE_READY and worker not in self.served:
            print(f"gateway: worker {worker} exited with {code} before it served (its error "
                  "is above); stopping the gateway", file=sys.stderr, flush=True)
            self.exit_code = code
            return None
        if time.monotonic() - self.spawned.get(worker, 0.0) > 60:
            self.backoff.pop(worker, None)  # it had served a while: not a crash loop
        delay = self.backoff.get(worker, RESTART_BACKOFF[0])
        print(f"gateway: worker {worker} exited with {code}; restarting in {delay:g}s",
              file=sys.stderr, flush=True)
        self.backoff[worker] = min(RESTART_BACKOFF[1], delay * 2)
        return delay

    async def _restart(self, worker: int, name: str, workdir: str, delay: float) -> None:
        """Start `worker` again after its backoff: a task of its own, so that the others'
        exits are seen and SIGTERM is obeyed meanwhile (the loop used to wait out each
        backoff, up to 30 s)."""
        await asyncio.sleep(delay)
        if not self.stopping:
            await self._spawn(worker, name, workdir)

    async def _stop_all(self) -> None:
        self.stopping = True
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.config.shutdown_grace + 10
        while any(p.poll() is None for p in self.procs.values()):
            if time.monotonic() > deadline:
                for proc in self.procs.values():
                    if proc.poll() is None:
                        proc.kill()
                break
            await asyncio.sleep(0.05)
        for worker in list(self.hub.writers):
            self.hub.detach(worker)
