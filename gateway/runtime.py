"""The gateway's parts, built from the config and owned for the life of the app.

`Gateway.start()` (called by the lifespan) opens the data-path upstream, probes the servers,
and starts the background loops; `Gateway.stop()` closes all of them. What changes while it
runs (shutting down, recent errors) is its `state` (`routes/state.py`). Nothing is global: the
app holds one Gateway in `app.state.gateway`; each route gets its own parts (`gateway/app.py`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

import httpx
from prometheus_client import CollectorRegistry

from gateway.admission.auth import Auth
from gateway.admission.key_limits import KeyLimits
from gateway.admission.slots import Admission
from gateway.admission.tenancy import Tenancy
from gateway.config.models import build_policies, configured_names, wants_token_ids
from gateway.config.settings import ConfigError, GatewayConfig
from gateway.discovery import KubernetesDiscovery
from gateway.dispatch.aborts import Aborts
from gateway.dispatch.attempt import Answer
from gateway.dispatch.bootstrap_rooms import RoomAllocator
from gateway.dispatch.inflight import InFlight, Tracked, new_id
from gateway.dispatch.ledger import Ledger
from gateway.dispatch.parallel_samples import Samples
from gateway.dispatch.pd import PDDispatcher, Timeouts
from gateway.dispatch.proxy import Proxy
from gateway.errors import BadRequest
from gateway.health.checker import HealthChecker
from gateway.health.deadlines import DeadlineOptions, LatencyModel
from gateway.observability.access_log import AccessLog
from gateway.observability.latency_history import LatencyHistory
from gateway.observability.metrics import Metrics
from gateway.observability.usage import Usage
from gateway.processes.siblings import Siblings
from gateway.request import RequestView
from gateway.routes.info_cache import InfoCaches
from gateway.routes.state import RuntimeState
from gateway.scheduling.affinity import SessionAffinity
from gateway.scheduling.models import Models, describe
from gateway.scheduling.scheduler import Scheduler
from gateway.servers.breaker import CircuitBreaker
from gateway.servers.pool import Server, ServerPool
from gateway.servers.probe import RoleMismatch, probe
from gateway.slo.gate import SloGate
from gateway.slo.objectives import Objectives
from gateway.timers import Timers
from gateway.tokens.context_check import ContextCheck
from gateway.tokens.prompt_tokens import PromptTokens
from gateway.upstream.base import UpstreamSettings, ssl_context
from gateway.upstream.choices import open_upstream
from gateway.upstream.httpx_client import HttpxUpstream, build_client

log = logging.getLogger("gateway")


class StartupError(RuntimeError):
    """The gateway cannot serve with this configuration (exit code 3)."""


class Gateway:
    version = "0.1.0"

    def __init__(self, config: GatewayConfig,
                 transport: httpx.AsyncBaseTransport | None = None, worker=None) -> None:
        self.config = config
        self.transport = transport
        self.worker = worker  # worker_main.WorkerContext with --workers, else None
        self.starting: asyncio.Task | None = None  # `start`, while it runs (app.py's lifespan)
        self.shared = worker.shared if worker is not None else None
        self.tls = self._tls()
        self.timers = Timers()  # the per-request deadlines (gateway/timers.py)
        self.state = RuntimeState()
        self.serving: dict = {}  # how the server side listens (set by the command line)
        self._flusher: asyncio.Task | None = None  # publishes buffered metrics every second
        self._latency_task: asyncio.Task | None = None
        self._build_routing()
        self._build_observability()
        self._build_admission()
        self._build_requests()
        self.dispatcher: PDDispatcher | None = None
        self.proxy: Proxy | None = None
        self.health: HealthChecker | None = None
        self.cluster = None
        self.discovery: KubernetesDiscovery | None = None
        if config.launch:
            from gateway.launch import LocalCluster  # noqa: PLC0415 - only with --launch

            self.cluster = LocalCluster(config, self.pool, self._new_server, self.scheduler.pairs)

    def _tls(self):
        """TLS of every upstream client (https servers); a bad CA bundle is a config error."""
        c = self.config
        try:
            return ssl_context(c.upstream_ca_file, c.upstream_insecure)
        except (OSError, ValueError) as exc:  # missing, unreadable, not a certificate
            raise ConfigError(f"upstream_ca_file {c.upstream_ca_file!r}: {exc}") from None

    def _build_routing(self) -> None:
        """The servers, the metrics that read them, the models and the scheduler."""
        config = self.config
        self.pool = ServerPool()
        for spec in config.prefill + config.decode:
            self.pool.add(self._new_server(spec.url, spec.role, spec.bootstrap_port, spec.model))
        self.registry = CollectorRegistry()
        self.metrics = Metrics(self.registry, self.pool, multiprocess=self.worker is not None)
        self.models = Models(  # which servers serve which model; each model's own policies
            self.pool, lambda model: build_policies(
                config, model, self.shared.prefixes if self.shared is not None else None),
            aliases=config.model_aliases, default=config.default_model,
            configured=configured_names(config), fallback=config.model)
        self.scheduler = Scheduler(self.pool, self.models,
                                   affinity=SessionAffinity.from_config(config, self.metrics))
        self.metrics.watch_scheduler(self.scheduler)

    def _build_observability(self) -> None:
        """Tracing (when on), usage per tenant and model, the access log, the latency plots."""
        config = self.config
        self.tracing = self._tracing() if config.otlp_endpoint else None
        self.access_log = None
        if config.access_log:
            self.access_log = AccessLog(config.access_log, self.metrics.access_log_dropped)
        # the SLO gate (gateway/slo/gate.py) learns from every ended request, then the log
        self.slo = SloGate(Objectives(config.slo_classes), self.scheduler.forecast,
                           self.metrics, self.scheduler.learns_from_every_request)
        self.usage = Usage(self.metrics, self.models.label,  # per tenant and model
                           self.slo.sink(self.access_log.write if self.access_log is not None
                                         else None))
        self.latency = LatencyHistory(self.read_metrics)  # the status page's plots

    def _build_admission(self) -> None:
        """Who may ask, how much, and in which order: keys, limits, tenants, slots."""
        config, worker = self.config, self.worker
        self.rooms = RoomAllocator(config.replica_id,
                                   worker_id=worker.id if worker is not None else None)
        self.admission = Admission(config.max_concurrency, config.max_queue,
                                   config.queue_timeout, self.metrics, shared=self._mine(),
                                   timers=self.timers)
        self.limits = KeyLimits(len(config.api_keys), config.rate_limit, config.rate_burst,
                                config.rate_limit_tokens, self.metrics, shared=self.shared)
        self.auth = Auth(config.api_keys, config.admin_api_keys, self.limits,
                         config.api_key_tenants, (config.host, *config.allowed_hosts))
        self.tenancy = Tenancy(config.tenants, self.auth.tenants, config.priority_header,
                               config.deadline_header, config.session_header)

    def _build_requests(self) -> None:
        """What requests meet on their way: the control client (the servers' other endpoints;
        it opens connections only when used), prompt tokens, the in-flight table, aborts."""
        c = self.config
        self.inflight = InFlight()
        self.tokens = PromptTokens(
            c.tokenizer_threads, always=wants_token_ids(c) or c.rate_limit_tokens > 0)
        self.client = build_client(c.connect_timeout, c.max_connections, self.transport,
                                   self.tls)
        self.control = HttpxUpstream(self.client)
        self.aborts = Aborts(self.inflight, self.control, timeout=5.0)
        self.context = ContextCheck(self.models, self.client, self.tokens)
        self.info_caches = InfoCaches(c.info_cache_ttl)
        self.siblings = Siblings(self.worker.control if self.worker is not None else None,
                                 self.pool, self.register, self.unregister, self.inflight,
                                 self.aborts)

    def describe(self) -> dict:
        """The gateway's own facts for /server_info and the status page."""
        policies = self.scheduler.policies
        return {"version": self.version, "replica_id": self.rooms.replica_id,
                "prefill_policy": policies["prefill"].name,
                "decode_policy": policies["decode"].name, "models": self.models.names()}

    def announcement(self) -> str:
        """The startup line: where, what, how, and whether strangers are kept out."""
        c = self.config
        serving = self.serving
        scheme = "https" if serving.get("tls") else "http"
        host = f"[{c.host}]" if ":" in c.host and not c.host.startswith("[") else c.host
        roles = ", ".join(
            f"{len(self.pool.role(r))} {r} ({len(self.pool.usable(r))} usable)"
            for r in ("prefill", "decode"))
        if not self.models.open:
            roles += "; models: " + ", ".join(f"{m.name} ({describe(m)})"
                                              for m in self.models.known.values())
        tls = ("TLS with client certificates" if serving.get("mtls")
               else "TLS" if serving.get("tls") else "no TLS")
        return (f"serving {scheme}://{host}:{c.port} ({tls}); servers: {roles}; policies: "
                f"prefill {self.scheduler.policies['prefill'].name}, decode "
                f"{self.scheduler.policies['decode'].name}; {self.auth.describe()}; "
                f"at most {serving.get('connections', '?')} client connections"
                + (f" per worker; {self.worker.count} workers" if self.worker is not None
                   else ""))

    def read_metrics(self) -> list:
        """The registry's metric families, this process's buffered figures published first
        (summed over the workers with --workers)."""
        self.metrics.flush()
        return list(self.registry.collect())

    def serve(self, view: RequestView, tracked: Tracked) -> Coroutine[Any, Any, Answer]:
        """One request: a PD dispatch with retries, or n of them for n > 1. The handler's
        coroutine itself, for the caller to await (no frame of its own per request)."""
        if view.n > 1:
            return self.samples.handle(view, tracked)
        return self.proxy.handle(view, tracked)

    async def probe_generation(self, view: RequestView) -> Answer:
        """A request the gateway makes itself (health generation), in flight as the gateway's."""
        return await self.proxy.handle(
            view, Tracked(request_id=f"probe-{new_id()}", owner="gateway"))

    def learned_latency(self, url: str) -> dict:
        """What the hang deadlines learned of one server (the admin listing)."""
        return self.dispatcher.model.snapshot(url)

    def _tracing(self):
        """The process's tracer (gateway/observability/tracing.py), imported only when tracing
        is on; a missing extra is a configuration error, never a silent "off"."""
        try:
            from gateway.observability.tracing import Tracing  # noqa: PLC0415 - [tracing] extra
            return Tracing(self.config, self.metrics, self.scheduler.policies_of, self.version)
        except ImportError as exc:
            raise ConfigError(f"otlp_endpoint: tracing needs the OpenTelemetry packages "
                              f"(pip install 'pd-gateway[tracing]'): {exc}") from None

    def _mine(self):
        """(shared state, this worker's id) with --workers, else None."""
        return (self.shared, self.worker.id) if self.worker is not None else None

    def _new_server(self, url: str, role: str, bootstrap_port: int | None,
                    model: str | None = None) -> Server:
        c = self.config
        server = Server(url, role, bootstrap_port, model=model,
                        breaker=CircuitBreaker(c.breaker_failures, c.breaker_cooldown))
        if self.worker is not None:  # in-flight counts summed over the worker processes
            server.shared = self.shared.share(url, self.worker.id)
        return server

    async def start(self) -> None:
        c = self.config
        if self.access_log is not None:
            try:
                self.access_log.start()
            except OSError as exc:
                raise StartupError(f"access log {c.access_log}: {exc}") from None
        if self.worker is not None:  # the server set as the other workers have it, before
            await self.worker.control.start()  # the command line's is probed (a switched one)
            await self.worker.control.synced()
        if c.upstream_insecure:
            log.warning("--upstream-insecure: certificates of https servers are NOT verified")
        if self.tracing is not None:
            self.tracing.start()
        control = self.control
        name = "httpx" if self.transport is not None else c.upstream_client  # tests' transport
        self.upstream = await open_upstream(name, UpstreamSettings(
            c.connect_timeout, c.upstream_max_connections, c.upstream_pool_timeout, self.tls),
            self.client)
        self.dispatcher = PDDispatcher(
            self.upstream, control, self.rooms,
            Timeouts(c.response_timeout, c.stream_idle_timeout, send=c.send_timeout),
            # a rescue stops attempts only if a retry can go elsewhere (the role's servers)
            Ledger(self.scheduler, self.metrics, self.pool.role),
            LatencyModel(DeadlineOptions(percentile=c.hang_percentile, factor=c.hang_factor,
                                         floor=c.hang_floor, cold=c.hang_cold)),
            timers=self.timers, forward_priority=c.forward_priority)
        self.proxy = Proxy(self.scheduler, self.dispatcher, self.metrics, c.max_attempts,
                           c.retry_backoff, c.retry_backoff_max, c.request_timeout,
                           failover=c.midstream_failover, readmit=self.slo.admit)
        self.samples = Samples(self.proxy)
        if self.cluster is not None:
            await self.cluster.start()
        await self._probe_all()
        self.scheduler.servers_changed()
        await self._load_tokenizer()
        self.health = HealthChecker(
            self.pool, self.client, endpoint=c.health_endpoint, interval=c.health_interval,
            timeout=c.health_timeout, failures=c.health_failures, reprobe=not c.skip_probe,
            successes=c.health_successes, loads_interval=c.loads_interval,
            on_down=lambda server: self.dispatcher.ledger.rescue(server, "was marked down"))
        self.health.start()
        self._flusher = asyncio.get_running_loop().create_task(self.metrics.run_flusher())
        self._latency_task = asyncio.get_running_loop().create_task(self.latency.run())
        await self.models.start()
        if c.prefill_selector or c.decode_selector:
            self.discovery = KubernetesDiscovery.from_config(
                c, on_add=self.register, on_remove=self.unregister,
                on_change=self.pool.notify, holding=self.pool.get, control=self.siblings.control)
            await self.discovery.start()

    async def _probe_all(self) -> None:
        """Verify roles, learn bootstrap ports. A server running the other PD role serves in it
        (switches outlive the flags); in no PD role: fatal; unreachable: down until it answers."""
        if self.config.skip_probe:
            for server in self.pool:
                server.verified = True
                if server.role == "prefill" and server.bootstrap_port is None:
                    server.bootstrap_port = 8998
            return
        servers, timeout = list(self.pool), self.config.probe_timeout
        results = await asyncio.gather(*(probe(self.client, w.url, w.role, timeout)
                                         for w in servers), return_exceptions=True)
        mismatches = []
        for server, result in zip(servers, results, strict=True):
            if isinstance(result, RoleMismatch) and result.mode in ("prefill", "decode"):
                log.warning("%s: serving it as a %s server", result, result.mode)
                self.unregister(server.url)
                await self.register(server.url, result.mode, None, model=server.model)
            elif isinstance(result, RoleMismatch):
                mismatches.append(str(result))
            elif isinstance(result, BaseException):
                server.healthy = False
                log.warning("%s server %s is not reachable yet (%s); it stays out of rotation "
                            "until it answers", server.role, server.url, result)
            else:
                server.apply_facts(result)
        if mismatches:
            raise StartupError("; ".join(mismatches))

    async def _load_tokenizer(self) -> None:
        """The default model's tokenizer (the only model or --default-model), from --tokenizer
        or its servers; other models keep the estimate. Several models and no default:
        --tokenizer serves all (give it only if they share one), none looked for on servers."""
        models = self.models
        try:
            model = models.default()
        except BadRequest:  # several models, none the default
            model = None
        servers = [w.url for ws in model.servers.values() for w in ws if w.healthy] \
            if model is not None else []
        serves = None
        if model is not None and model.name:
            def serves(view) -> bool:
                return models.open or models.of(view) is model
        await self.tokens.load(self.config.tokenizer, self.client, servers, serves)

    async def register(self, url: str, role: str, bootstrap_port: int | None,
                       require_probe: bool = False, model: str | None = None) -> Server:
        """Add a server at runtime: probed now if it answers, else health-checked until then.
        With `require_probe` (the admin API) a server that does not answer as an SGLang
        server of that role is refused: nobody can point traffic at an arbitrary URL.
        `model` names its model (a pod's label); else its probe says."""
        server = self._new_server(url, role, bootstrap_port, model)
        try:
            server.apply_facts(await probe(self.client, url, role, self.config.probe_timeout))
        except RoleMismatch as exc:
            raise BadRequest(str(exc)) from None
        except ConnectionError as exc:
            if require_probe:
                raise BadRequest(f"{url} did not answer as an SGLang {role} server: {exc}") \
                    from None
            server.healthy = False
        self.pool.add(server)
        if self.health is not None:
            self.health.watch(server)
        return server

    def unregister(self, url: str) -> Server | None:
        """Out of the pool, with what was learned of it and its metric series: added again at
        the same URL (a role switch, a pod replaced) it starts afresh, not with its old pairs'
        quarantines nor the deadlines learned of its old role or process."""
        server = self.pool.remove(url)
        if server is not None:
            if self.health is not None:
                self.health.unwatch(url)
            self.scheduler.pairs.forget(url)
            self.metrics.forget(server)
            if self.dispatcher is not None:
                self.dispatcher.model.forget(url)
        return server

    async def stop(self) -> None:
        self.state.shutting_down = True
        if self._flusher is not None:
            self._flusher.cancel()
        if self._latency_task is not None:
            self._latency_task.cancel()
        self.metrics.flush()
        await self.info_caches.close()
        if self.discovery is not None:
            await self.discovery.stop()
        await self.models.stop()
        if self.health is not None:
            await self.health.stop()
        if self.dispatcher is not None:
            await self.dispatcher.close()
            await self.upstream.close()
        await self.client.aclose()
        if self.cluster is not None:
            await self.cluster.stop()
        if self.worker is not None:
            await self.worker.control.stop()
        self.tokens.close()
        self.timers.close()
        if self.tracing is not None:  # the last spans leave (bounded), off the event loop
            await asyncio.to_thread(self.tracing.stop)
        if self.access_log is not None:  # last: requests that ended during shutdown too
            self.access_log.close()
