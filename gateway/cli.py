"""Command-line entry: build the config, then serve it with uvicorn (uvloop, httptools)."""

from __future__ import annotations

import asyncio
import gc
import logging
import resource
import ssl
import sys

import uvicorn

from gateway.app import build_app
from gateway.config.settings import (
    EXIT_CONFIG_ERROR,
    EXIT_STARTUP_FAILURE,
    ConfigError,
    load_config,
)
from gateway.processes.fair_accept import ConnectionShare, FairListener
from gateway.processes.supervisor import Supervisor, bound_socket, worker_count
from gateway.routes.server_protocol import ServerLimits, guarded_protocol

KEY_FLAGS = ("--api-keys", "--api-key", "--admin-api-keys")
FD_RESERVE = 128  # descriptors kept for logs, probes, KV-event sockets and the like
MAX_OPEN_FILES = 1 << 20
BACKLOG = 2048
STOP_POLL = 0.1  # seconds between looks at a stop asked while the gateway starts


def tune_gc() -> None:
    """Fewer cyclic-GC passes: the hot path allocates many short-lived objects that reference
    counting frees, and the collector was ~10% of a small request's CPU (docs/BENCHMARKS.md).
    Objects alive after startup are frozen out of the collector's generations."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)


def connection_limit(configured: int) -> int:
    """Client connections served at once: as configured, or a third of the open-file limit
    (raised to its hard maximum first), since a request may hold two upstream connections."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else MAX_OPEN_FILES
    target = min(target, MAX_OPEN_FILES)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if configured:
        return configured
    return max(64, (soft - FD_RESERVE) // 3)


class GatewayServer(uvicorn.Server):
    """uvicorn's server, saying once what it serves when the port is bound."""

    def __init__(self, config: uvicorn.Config, gateway) -> None:
        super().__init__(config)
        self.gateway = gateway
        self.stopped_starting = False  # a signal came while the gateway started

    async def shutdown(self, sockets: list | None = None) -> None:
        """A request cut by the end of `--shutdown-grace` is answered in JSON (503) by its
        endpoint, which reads this flag. The listeners take the connections queued on the
        socket, and those are made, before uvicorn tells each connection to finish: one
        made later would be kept alive, and hold the exit until the grace ends."""
        self.gateway.state.shutting_down = True
        for server in self.servers:
            server.close()
        for server in self.servers:
            await server.wait_closed()
        await super().shutdown(sockets)

    async def startup(self, sockets: list) -> None:
        """`sockets`: bound by `serve` (or the supervisor) and accepted by the gateway itself,
        not by uvloop's server, which takes about one connection per loop iteration while the
        loop is busy: a worker on the shared socket one per wake-up, so that a burst is spread
        over the workers; a process that owns its queue (a single gateway, a SO_REUSEPORT
        worker) in batches (processes/fair_accept.py)."""
        worker = self.gateway.worker
        watch = asyncio.ensure_future(self._stop_starting_on_signal())
        try:
            await super().startup([])  # uvicorn's lifespan and state, no server of its own
        except SystemExit:  # uvicorn's answer to a failed start; a stopped one is no failure
            if not self.stopped_starting:
                raise
            return
        finally:
            watch.cancel()
        if not self.started:
            return
        for sock in sockets:  # bound, listening only now: before, connections are refused
            sock.listen(BACKLOG)
        share = ConnectionShare(worker.shared, worker.id,
                                lambda: len(self.server_state.connections)) \
            if worker is not None and self.gateway.config.workers_socket == "shared" else None
        self.servers = [FairListener(asyncio.get_running_loop(), sock, self._protocol,
                                     self.config.ssl, share) for sock in sockets]
        if worker is None:
            print(f"gateway: {self.gateway.announcement()}", file=sys.stderr, flush=True)
        else:
            if worker.id == 0:  # one line for the whole gateway, from its first worker
                print(f"gateway: {self.gateway.announcement()}", file=sys.stderr, flush=True)
            worker.control.ready()

    async def _stop_starting_on_signal(self) -> None:
        """SIGTERM while the gateway starts (a local cluster's servers may take minutes)
        cancels the start: its lifespan stops what started (app.py), and the process exits."""
        while True:
            await asyncio.sleep(STOP_POLL)
            start = self.gateway.starting  # the gateway's own start (app.py's lifespan)
            if self.should_exit and start is not None and not start.done():
                self.stopped_starting = True
                start.cancel()
                return

    def _protocol(self) -> asyncio.Protocol:
        """A connection's protocol, built as uvicorn's own `startup` builds it."""
        return self.config.http_protocol_class(config=self.config,
                                               server_state=self.server_state,
                                               app_state=self.lifespan.state)


def keys_on_command_line(argv: list[str]) -> list[str]:
    """The key flags given as arguments: their values show in `ps` and /proc/<pid>/cmdline."""
    return [a.split("=", 1)[0] for a in argv if a.split("=", 1)[0] in KEY_FLAGS]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    flags = keys_on_command_line(argv)
    if flags:
        print(f"gateway: warning: API keys given with {', '.join(flags)} are visible to every "
              "user of this host (ps); use --api-key-file/--admin-api-key-file or "
              "GATEWAY_API_KEYS/GATEWAY_ADMIN_API_KEYS", file=sys.stderr)
    try:
        config = load_config(argv)
    except (ConfigError, ValueError) as exc:  # ValueError: bad policy options
        print(f"gateway: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    if worker_count(config.workers) > 1:
        try:
            return Supervisor(config, argv).run()
        except OSError as exc:  # the port is taken, or the host cannot be bound
            print(f"gateway: startup failed: {exc}", file=sys.stderr)
            return EXIT_STARTUP_FAILURE
    return serve(config)


def serve(config, sockets: list | None = None, worker=None) -> int:
    """Run one serving process: the whole gateway (`worker` None) or one of N workers."""
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app = build_app(config, worker=worker)
    except ValueError as exc:
        print(f"gateway: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    # per serving process: what it bounds is the process's own file descriptors, and the
    # kernel does not spread connections evenly over workers (a share of limit/N per worker
    # answered 503 while the gateway as a whole had room: docs/WORKERS.md). The protocol
    # bounds them (a JSON 503 with Retry-After), not uvicorn's limit_concurrency.
    connections = connection_limit(config.max_client_connections)
    limits = ServerLimits(head_timeout=config.head_timeout, body_timeout=config.body_timeout,
                          max_header_count=config.max_header_count,
                          max_head_bytes=config.max_header_bytes,
                          send_timeout=config.send_timeout, max_connections=connections,
                          keep_alive=config.keep_alive_timeout)
    app.state.gateway.serving = {"connections": connections, "tls": bool(config.ssl_certfile),
                                 "mtls": bool(config.ssl_ca_certs)}
    if sockets is None:  # a single gateway binds as the supervisor does, and accepts itself
        try:
            sockets = [bound_socket(config)]
        except OSError as exc:  # the port is taken, or the host cannot be bound
            print(f"gateway: startup failed: {exc}", file=sys.stderr)
            return EXIT_STARTUP_FAILURE
    tune_gc()
    refusals = app.state.gateway.metrics.protocol_refusals
    server = GatewayServer(uvicorn.Config(
        app, host=config.host.strip("[]"), port=config.port, loop="uvloop",
        http=guarded_protocol(limits, app.state.gateway.timers,
                              lambda reason: refusals.labels(reason).inc()),
        ws="none", lifespan="on",
        log_level=config.log_level,
        access_log=False, proxy_headers=False, server_header=False,
        timeout_graceful_shutdown=config.shutdown_grace, backlog=BACKLOG,
        timeout_keep_alive=config.keep_alive_timeout,
        ssl_certfile=config.ssl_certfile,
        ssl_keyfile=config.ssl_keyfile, ssl_ca_certs=config.ssl_ca_certs,
        ssl_cert_reqs=ssl.CERT_REQUIRED if config.ssl_ca_certs else ssl.CERT_NONE),
        app.state.gateway)
    server.run(sockets=sockets)
    if server.stopped_starting:
        print("gateway: stopped while starting", file=sys.stderr)
        return 0
    if not server.started:
        print("gateway: startup failed (see the error above)", file=sys.stderr)
        return EXIT_STARTUP_FAILURE
    return 0
