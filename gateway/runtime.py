"""The gateway's parts, built from the config and owned for the life of the app.

`Gateway.start()` (called by the lifespan) opens the HTTP client, probes the servers, and
starts the background loops; `Gateway.stop()` closes all of them. Nothing here is global:
the app holds one Gateway in `app.state.gateway`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections import deque

import httpx
from prometheus_client import CollectorRegistry

from gateway.admission import Admission, KeyChecker
from gateway.aiohttp_upstream import AiohttpUpstream
from gateway.bootstrap import RoomAllocator
from gateway.breaker import CircuitBreaker
from gateway.config import ConfigError, GatewayConfig
from gateway.discovery import KubernetesDiscovery
from gateway.errors import BadRequest, GatewayError
from gateway.health import HealthChecker
from gateway.metrics import Metrics
from gateway.pd import PDDispatcher, Timeouts
from gateway.policies import create_policy
from gateway.probe import RoleMismatch, probe
from gateway.proxy import Proxy
from gateway.scheduler import Scheduler
from gateway.upstream import FastUpstream, HttpxUpstream, build_client, ssl_context
from gateway.workers import Worker, WorkerPool

log = logging.getLogger("gateway")

DEFAULT_PREFILL_POLICY = "cache_aware"
DEFAULT_DECODE_POLICY = "least_load"
RECENT_ERRORS = 50


class StartupError(RuntimeError):
    """The gateway cannot serve with this configuration (exit code 3)."""


class Gateway:
    version = "0.1.0"

    def __init__(self, config: GatewayConfig,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.config = config
        self.transport = transport
        if config.upstream_max_connections < 1 or config.upstream_pool_timeout <= 0:
            raise ConfigError("upstream_max_connections must be at least 1 and "
                              "upstream_pool_timeout positive")
        try:  # TLS of every upstream client (https servers); a bad CA bundle is a config error
            self.tls = ssl_context(config.upstream_ca_file, config.upstream_insecure)
        except (OSError, ValueError) as exc:  # missing, unreadable, not a certificate
            raise ConfigError(f"upstream_ca_file {config.upstream_ca_file!r}: {exc}") from None
        self.pool = WorkerPool()
        for spec in config.prefill + config.decode:
            self.pool.add(self._new_worker(spec.url, spec.role, spec.bootstrap_port))
        self.registry = CollectorRegistry()
        self.metrics = Metrics(self.registry, self.pool)
        options = config.policy_options or {}
        prefill_name = config.prefill_policy or config.policy or DEFAULT_PREFILL_POLICY
        decode_name = config.decode_policy or config.policy or DEFAULT_DECODE_POLICY
        self.scheduler = Scheduler(
            self.pool,
            create_policy(prefill_name, "prefill", options.get(prefill_name)),
            create_policy(decode_name, "decode", options.get(decode_name)),
        )
        self.rooms = RoomAllocator(config.replica_id)
        self.admission = Admission(config.max_concurrency, config.max_queue,
                                   config.queue_timeout, self.metrics)
        self.inference_keys = KeyChecker(config.api_keys, config.rate_limit, config.rate_burst,
                                         self.metrics)
        self.admin_keys = KeyChecker(config.admin_api_keys or config.api_keys)
        self.shutting_down = False
        self.recent_errors: deque[dict] = deque(maxlen=RECENT_ERRORS)
        # request ids for requests that bring none: a random process prefix plus a counter
        prefix = secrets.token_hex(6)
        self.request_ids = (f"{prefix}-{n:x}" for n in itertools.count(1))
        self.client: httpx.AsyncClient | None = None
        self.dispatcher: PDDispatcher | None = None
        self.proxy: Proxy | None = None
        self.health: HealthChecker | None = None
        self.cluster = None
        self.discovery: KubernetesDiscovery | None = None
        if config.launch:
            from gateway.launch import LocalCluster  # noqa: PLC0415 - only with --launch

            self.cluster = LocalCluster(config, self.pool, self._new_worker)

    def note_error(self, err: GatewayError, endpoint: str, request_id: str) -> None:
        """Keep the last errors for the status page (bounded; no request bodies)."""
        self.recent_errors.append({"time": time.time(), "endpoint": endpoint,
                                   "status": err.status, "type": err.error_type,
                                   "message": err.message[:300],
                                   "request_id": request_id})

    def _new_worker(self, url: str, role: str, bootstrap_port: int | None) -> Worker:
        c = self.config
        return Worker(url, role, bootstrap_port,
                      breaker=CircuitBreaker(c.breaker_failures, c.breaker_cooldown))

    async def start(self) -> None:
        c = self.config
        if c.upstream_insecure:
            log.warning("--upstream-insecure: certificates of https servers are NOT verified")
        self.client = build_client(c.connect_timeout, c.max_connections, self.transport,
                                   self.tls)
        control = HttpxUpstream(self.client)
        if self.transport is not None or c.upstream_client == "httpx":
            self.upstream = control
        elif c.upstream_client == "aiohttp":
            self.upstream = AiohttpUpstream(c.connect_timeout, c.upstream_max_connections,
                                            c.upstream_pool_timeout, self.tls)
            await self.upstream.start()
        else:
            self.upstream = FastUpstream(c.connect_timeout, c.upstream_max_connections,
                                         c.upstream_pool_timeout, self.tls)
        self.dispatcher = PDDispatcher(
            self.upstream, control, self.rooms,
            Timeouts(c.response_timeout, c.stream_idle_timeout))
        self.proxy = Proxy(self.scheduler, self.dispatcher, self.metrics, c.max_attempts,
                           c.retry_backoff, c.retry_backoff_max, c.request_timeout)
        self.dispatcher.on_leg_done = self.proxy.leg_done
        self.dispatcher.on_prefill_body = self.proxy.prefill_answered
        if self.cluster is not None:
            await self.cluster.start()
        await self._probe_all()
        self.scheduler.workers_changed()
        self.health = HealthChecker(
            self.pool, self.client, endpoint=c.health_endpoint, interval=c.health_interval,
            timeout=c.health_timeout, failures=c.health_failures,
            successes=c.health_successes, loads_interval=c.loads_interval)
        self.health.start()
        for policy in self.scheduler.policies.values():
            await policy.start()
        if c.prefill_selector or c.decode_selector:
            self.discovery = KubernetesDiscovery.from_config(
                c, on_add=self.register, on_remove=self.unregister)
            await self.discovery.start()

    async def _probe_all(self) -> None:
        """Verify roles and learn bootstrap ports. A wrong role is fatal; an unreachable
        server starts out down and is probed again by the health checker."""
        if self.config.skip_probe:
            for worker in self.pool:
                worker.verified = True
                if worker.role == "prefill" and worker.bootstrap_port is None:
                    worker.bootstrap_port = 8998
            return
        workers = list(self.pool)
        results = await asyncio.gather(
            *(probe(self.client, w.url, w.role, self.config.probe_timeout) for w in workers),
            return_exceptions=True)
        mismatches = []
        for worker, result in zip(workers, results, strict=True):
            if isinstance(result, RoleMismatch):
                mismatches.append(str(result))
            elif isinstance(result, BaseException):
                worker.healthy = False
                log.warning("%s server %s is not reachable yet (%s); it stays out of rotation "
                            "until it answers", worker.role, worker.url, result)
            else:
                worker.apply_facts(result)
        if mismatches:
            raise StartupError("; ".join(mismatches))

    async def register(self, url: str, role: str, bootstrap_port: int | None) -> Worker:
        """Add a server at runtime: probed now if it answers, else health-checked until then."""
        worker = self._new_worker(url, role, bootstrap_port)
        try:
            worker.apply_facts(await probe(self.client, url, role, self.config.probe_timeout))
        except RoleMismatch as exc:
            raise BadRequest(str(exc)) from None
        except ConnectionError:
            worker.healthy = False
        self.pool.add(worker)
        if self.health is not None:
            self.health.watch(worker)
        return worker

    def unregister(self, url: str) -> Worker | None:
        worker = self.pool.remove(url)
        if worker is not None and self.health is not None:
            self.health.unwatch(url)
        return worker

    async def stop(self) -> None:
        self.shutting_down = True
        if self.discovery is not None:
            await self.discovery.stop()
        for policy in self.scheduler.policies.values():
            await policy.stop()
        if self.health is not None:
            await self.health.stop()
        if self.dispatcher is not None:
            await self.dispatcher.close()
            await self.upstream.close()
        if self.client is not None:
            await self.client.aclose()
        if self.cluster is not None:
            await self.cluster.stop()
