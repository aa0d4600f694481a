"""`--launch`: start a local cluster with backends.launcher and keep the pool in step with it.

Each server joins the pool with the model name the topology starts it with (several models:
`models:` in the topology, docs/LAUNCHER.md), else the one its probe reports.
The launcher reports each server's state; only READY servers are healthy in the pool, so a
crashed server leaves rotation at once and returns when its restart is ready again: with its
breaker closed and its pairs' health forgotten, as a pod that Kubernetes discovery sees leave
and come back is (`Gateway.unregister`). A pair quarantined for the old process's failures
(its Mooncake sessions died with it) would otherwise keep the new process from that partner
for the rest of the cooldown, doubled by each probe that meets the restart's first slow
moments, up to two minutes.
"""

from __future__ import annotations

import logging

from backends.launcher import (
    Launcher,
    ServerHandle,
    ServerState,
    Topology,
    default_topology,
    load_topology,
)
from backends.launcher.ports import reserve
from gateway.config.settings import GatewayConfig
from gateway.health.pairs import PairHealth
from gateway.servers.pool import Server, ServerPool

log = logging.getLogger("gateway.launch")


def topology_of(config: GatewayConfig) -> Topology:
    """The cluster `--launch` starts: `--launch-config`, else the default one. Its free ports
    are picked now, before the gateway binds its own port, so that one is held back."""
    reserve(config.port)
    if config.launch_config:
        return load_topology(config.launch_config)
    return default_topology(config.backend, config.num_prefill, config.num_decode)


class LocalCluster:
    def __init__(self, config: GatewayConfig, pool: ServerPool, new_server,
                 pairs: PairHealth) -> None:
        self.topology = topology_of(config)
        self.pool = pool
        self.pairs = pairs
        self._new_server = new_server
        self.launcher = Launcher(self.topology, on_state=self._on_state, handle_signals=False)

    async def start(self) -> None:
        """Start every server and wait until all are ready (raises on failure)."""
        await self.launcher.start()
        for server in self.launcher.servers:
            if self.pool.get(server.url) is None:
                self.pool.add(self._new_server(server.url, server.role, server.bootstrap_port,
                                               self.topology.model_name_of(server.spec)))

    def _on_state(self, launched: ServerHandle, state: ServerState) -> None:
        server: Server | None = self.pool.get(launched.url)
        if server is None:
            return
        # while its process is down the launcher alone puts it back: a health check that
        # counted a request success from before the crash marked it up with no process there
        server.held_out = state is not ServerState.READY
        if state is ServerState.READY:
            server.healthy = True
            server.breaker.reset()
            self.pairs.forget(launched.url)  # new sessions with every partner
            log.warning("%s server %s is ready again", launched.role, launched.url)
        else:
            server.healthy = False
            log.warning("%s server %s is %s: out of rotation", launched.role, launched.url, state)

    async def stop(self) -> None:
        await self.launcher.stop()
