"""Every Prometheus metric of the gateway, defined in one place on an injected registry.

Names start with `gateway_`; labels are bounded (endpoint, status class, server URL, role,
policy, reason), never request ids. Per-server state (health, breaker, in-flight) is read from
the pool at scrape time by a collector, so the request path does not update gauges for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.observability.metric_buffer import BufferedCounter, BufferedHistogram, MetricBuffer
from gateway.servers.pool import ServerPool, breaker_state_code

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class Metrics:
    def __init__(self, registry: CollectorRegistry, pool: ServerPool,
                 multiprocess: bool = False) -> None:
        """`registry` is what /metrics shows. With `--workers` (`multiprocess`) every worker
        process writes its counters and histograms to prometheus_client's multiprocess files
        (PROMETHEUS_MULTIPROC_DIR, set by the supervisor) and a scrape of any worker sums all
        of them; the gauges read at scrape time (pool, scheduler) are the answering server's
        view, with in-flight figures summed over the workers."""
        self.registry = registry
        self.multiprocess = multiprocess
        own = registry
        if multiprocess:
            from prometheus_client import multiprocess as mp  # noqa: PLC0415 - workers only

            mp.MultiProcessCollector(registry)
            own = None  # the values live in the multiprocess files
        self._request_metrics(own)
        self._routing_metrics(own)
        self._client_metrics(own)
        self._tenant_metrics(own)
        registry.register(PoolCollector(pool))
        self.buffer = MetricBuffer()  # the per-request updates (observability/metric_buffer.py)
        self._tallies: list[Tally] = []  # counts kept elsewhere, published as counters

    def _request_metrics(self, own: CollectorRegistry | None) -> None:
        """Requests answered, their latency and the admission wait."""
        self.requests = Counter(
            "gateway_requests", "Requests answered, by endpoint and HTTP status",
            ["endpoint", "status"], registry=own)
        self.e2e = Histogram(
            "gateway_request_duration_seconds", "End-to-end request latency at the gateway",
            ["endpoint"], buckets=LATENCY_BUCKETS, registry=own)
        self.ttft = Histogram(
            "gateway_time_to_first_token_seconds",
            "Time from request arrival to the first byte of the answer body",
            ["endpoint", "stream"], buckets=LATENCY_BUCKETS, registry=own)
        self.itl = Histogram(
            "gateway_inter_token_latency_seconds", "Gap between streamed chunks",
            ["endpoint"], buckets=ITL_BUCKETS, registry=own)
        self.queue_time = Histogram(
            "gateway_queue_time_seconds", "Time spent waiting for an admission slot",
            buckets=LATENCY_BUCKETS, registry=own)

    def _routing_metrics(self, own: CollectorRegistry | None) -> None:
        """Where requests went: retries, failures, choices, cache figures."""
        self.retries = Counter(
            "gateway_retries", "Attempts retried on another pair, by failed leg and reason",
            ["leg", "reason"], registry=own)
        self.leg_failures = Counter(
            "gateway_upstream_failures", "Failed legs by server, role and reason",
            ["server", "role", "reason"], registry=own)
        self.rejections = Counter(
            "gateway_admission_rejections", "Requests refused before dispatch, by reason",
            ["reason"], registry=own)
        self.decisions = Counter(
            "gateway_routing_decisions", "Servers chosen, by role, policy and server",
            ["role", "policy", "server"], registry=own)
        self.pair_failures = Counter(
            "gateway_pair_failures", "Failures blamed on one (prefill, decode) pair, not on "
            "its servers", ["prefill", "decode"], registry=own)
        self.rank_requests = Counter(
            "gateway_dp_rank_requests", "Prefill legs steered to each DP rank of a server",
            ["server", "rank"], registry=own)
        self.prompt_tokens = Counter(
            "gateway_prompt_tokens", "Prompt tokens reported by prefill servers",
            ["server"], registry=own)
        self.cached_tokens = Counter(
            "gateway_cached_tokens", "Prompt tokens served from a prefill server's prefix cache",
            ["server"], registry=own)
        self.predicted_tokens = Counter(
            "gateway_predicted_cached_tokens",
            "Prompt tokens the router expected to be cached on the chosen prefill",
            ["server"], registry=own)

    def _client_metrics(self, own: CollectorRegistry | None) -> None:
        """What the clients got: bytes, failovers, slow clients, departures."""
        self.stream_bytes = Counter(
            "gateway_streamed_bytes", "Response body bytes sent to clients",
            ["endpoint"], registry=own)
        self.failovers = Counter(
            "gateway_stream_failovers", "Streams whose decode failed mid-stream, by outcome "
            "(continued on another pair, failed, not_resumable)", ["endpoint", "outcome"],
            registry=own)
        self.slow_clients = Counter(
            "gateway_slow_clients", "Streams ended because the client stopped reading",
            ["endpoint"], registry=own)
        self.disconnects = Counter(
            "gateway_client_disconnects", "Clients that went away before the answer ended",
            ["endpoint"], registry=own)
        self.panic_picks = Counter(
            "gateway_panic_picks", "Servers picked with no fully usable one of their role "
            "(their breakers open or half-open, or all marked down by health checks)",
            ["role"], registry=own)
        self.protocol_refusals = Counter(
            "gateway_protocol_refusals", "Connections the HTTP protocol answered and closed "
            "itself (malformed, url_too_long, headers_too_large, connection_limit) or closed at "
            "a deadline (head_timeout, body_timeout): never seen by the app",
            ["reason"], registry=own)
        self.trace_spans_dropped = Counter(
            "gateway_trace_spans_dropped", "Trace spans not exported (tracing on), by reason: "
            "queue_full, export_failed", ["reason"], registry=own)

    def _tenant_metrics(self, own: CollectorRegistry | None) -> None:
        """Usage per tenant and model, admission per tenant, the access log, sessions."""
        # Usage per tenant and model (gateway/observability/usage.py): tenants come from the
        # key file, models from the servers; anything else is "other"
        self.tenant_requests = Counter(
            "gateway_tenant_requests", "Inference requests answered, per tenant and model",
            ["tenant", "model"], registry=own)
        self.tenant_errors = Counter(
            "gateway_tenant_errors", "Inference requests answered with an error status (4xx, "
            "including 499 for a client that left, or 5xx), per tenant and model",
            ["tenant", "model", "status_class"], registry=own)
        self.tenant_tokens = Counter(
            "gateway_tenant_tokens", "Tokens per tenant and model: prompt tokens the prefill "
            "servers report as cached or computed (uncached), and completion tokens the "
            "answers report", ["tenant", "model", "kind"], registry=own)
        self.access_log_dropped = Counter(
            "gateway_access_log_dropped", "Access log lines dropped because the writer could "
            "not keep up (or the file could not be written)", registry=own)
        self.admission_outcomes = Counter(
            "gateway_admission_requests", "Inference requests by tenant, priority class and "
            "admission outcome (admitted, queued, queue_full, shed, queue_timeout, deadline, "
            "left); tenants come from the configuration", ["tenant", "priority", "outcome"],
            registry=own)
        self.tenant_queue_time = Histogram(
            "gateway_tenant_queue_time_seconds", "Time queued requests waited for a slot, by "
            "tenant and priority class", ["tenant", "priority"], buckets=LATENCY_BUCKETS,
            registry=own)
        self.slo_outcomes = Counter(
            "gateway_slo_requests", "Requests with a latency objective, by priority class and "
            "outcome: met, missed (TTFT or mean ITL over its objective), shed (refused "
            "before any prefill work: no pair could meet it), queued (waited for a pair "
            "that could)", ["priority", "outcome"], registry=own)
        self.slo_prediction_error = Histogram(
            "gateway_slo_prediction_error", "Observed / predicted latency of each request "
            "the SLO model forecast (1: exact), by kind: ttft, itl (mean)", ["kind"],
            buckets=(0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.11, 1.25, 1.5, 2, 4), registry=own)
        self.session_picks = Counter(
            "gateway_session_picks", "Prefill choices for requests with a session id: kept "
            "(its remembered server), placed (a new session, hashed onto the servers), moved "
            "(its server was unusable or overloaded)", ["outcome"], registry=own)
        self.role_switches = Counter(
            "gateway_role_switches", "Role switches asked of the admin API, by outcome: "
            "switched, refused (the server said no; put back as it was), busy (still in flight "
            "at the deadline; put back), failed (broken midway; taken out), conflict (another "
            "switch running, or a role would be left empty), cancelled (cut off by the end of "
            "--shutdown-grace)", ["outcome"], registry=own)
        self.rebalance_decisions = Counter(
            "gateway_rebalance_decisions", "Automatic role switches asked (--rebalance), by "
            "the role giving a server, the role getting it, the pressure signal that called "
            "for it (e.g. prefill_queue, decode_slots) and the switch's outcome",
            ["from", "to", "reason", "outcome"], registry=own)

    def buffered_counter(self, child) -> BufferedCounter:
        return self.buffer.counter(child)

    def buffered_histogram(self, child) -> BufferedHistogram:
        return self.buffer.histogram(child)

    def child(self, server, metric, *labels: str, url_first: bool = False) -> BufferedCounter:
        """The buffered child of counter `metric` for this server (and labels), resolved once
        per server: `labels()` costs a lock and a dict lookup per call."""
        key = (metric, labels)  # metrics hash by identity
        child = server.metric_children.get(key)
        if child is None:
            values = (server.url, *labels) if url_first or not labels else (*labels, server.url)
            child = server.metric_children[key] = self.buffer.counter(metric.labels(*values))
        return child

    def forget(self, server) -> None:
        """A server left the pool: its labelled series go (pod churn at new addresses grew
        /metrics and the flush for the gateway's whole life), what it counted published
        first. With `--workers` the multiprocess files keep the series until a restart:
        prometheus_client removes no labels in that mode."""
        children, server.metric_children = server.metric_children, {}
        for (metric, labels), buffered in children.items():
            buffered.flush()
            self.buffer.discard(buffered)
            if not self.multiprocess:  # the key does not say where the URL went: try both
                metric.remove(server.url, *labels)
                if labels:
                    metric.remove(*labels, server.url)

    def flush(self) -> None:
        """Publish what the request path buffered (before any read of the registry)."""
        for tally in self._tallies:
            tally.publish()
        self.buffer.flush()

    async def run_flusher(self, interval: float = 1.0) -> None:
        """Publish every `interval` seconds (so other workers' scrapes see this one)."""
        while True:
            await asyncio.sleep(interval)
            self.flush()

    def watch_scheduler(self, scheduler) -> None:
        """Gauges of the scheduler's own state (quarantined pairs), and its panic picks as a
        counter: `scheduler.panics` is this process's count since it started, so exported as
        it is a scrape answered by another worker, or after a restart, read a smaller value;
        its growth goes to `gateway_panic_picks` (multiprocess files with `--workers`: summed
        over the workers, a dead worker's part kept) at every flush."""
        self.registry.register(SchedulerCollector(scheduler))
        self._tallies.append(Tally(scheduler.panics, self.panic_picks))


    def watch_rebalance(self, figures) -> None:
        """`gateway_desired_servers` and `gateway_role_pressure` (gateway/servers/rebalance.py;
        `figures()` gives {"desired": {(model, role): n}, "pressure": {...}})."""
        self.registry.register(RebalanceCollector(figures))

    def watch_slo(self, gate) -> None:
        """Gauges of the SLO gate (gateway/slo/gate.py), read at scrape time."""
        self.registry.register(SloCollector(gate))

    def watch_admission(self, admission) -> None:
        """Gauges of the admission queue (read at scrape time: this process's queue)."""
        self.registry.register(AdmissionCollector(admission))


class Tally:
    """A dict of running counts kept by another part ({label: count}), published as the
    growth of a labelled counter since the last publish."""

    def __init__(self, counts: dict[str, int], counter: Counter) -> None:
        self.counts = counts
        self.counter = counter
        self.published: dict[str, int] = {}
        for label in counts:  # shown at 0 from the start
            counter.labels(label)

    def publish(self) -> None:
        for label, count in list(self.counts.items()):
            grown = count - self.published.get(label, 0)
            if grown > 0:
                self.counter.labels(label).inc(grown)
            self.published[label] = count


class AdmissionCollector(Collector):
    """Requests holding a slot and waiting per tenant and class, read at scrape time."""

    def __init__(self, admission) -> None:
        self.admission = admission

    def collect(self) -> Iterable[GaugeMetricFamily]:
        active = GaugeMetricFamily("gateway_admission_active",
                                   "Requests holding an admission slot in this process")
        active.add_metric([], self.admission.active)
        waiting = GaugeMetricFamily(
            "gateway_admission_waiting", "Requests waiting for a slot in this process, by "
            "tenant and priority class", labels=["tenant", "priority"])
        for (tenant, priority), count in sorted(self.admission.waiting().items()):
            waiting.add_metric([tenant, priority], count)
        yield from (active, waiting)
        try:  # scraped from the loop's own /metrics route; elsewhere there is no loop to count
            tasks = len(asyncio.all_tasks())
        except RuntimeError:
            return
        alive = GaugeMetricFamily(
            "gateway_event_loop_tasks", "asyncio tasks alive in this process (at rest, a "
            "count that grows after traffic is a leak)")
        alive.add_metric([], tasks)
        yield alive


class SloCollector(Collector):
    """What the SLO gate refuses by, this process's: an operator whose gate refuses while
    the servers idle sees whether the margin (stale errors) or the queue bound decides."""

    def __init__(self, gate) -> None:
        self.gate = gate

    def collect(self) -> Iterable[GaugeMetricFamily]:
        gate = self.gate
        margin = GaugeMetricFamily(
            "gateway_slo_margin", "The factor the SLO gate multiplies each forecast TTFT by "
            "(the 0.9 quantile of observed / forecast over recent streams; 0.5-4)")
        margin.add_metric([], gate.margin.factor())
        waiting = GaugeMetricFamily(
            "gateway_slo_waiting", "Requests queued in the SLO gate for a pair that can meet "
            "their objective")
        waiting.add_metric([], gate.waiting())
        bound = GaugeMetricFamily(
            "gateway_slo_queue_bound_seconds", "Queueing a request of each class is admitted "
            "to while others wait in the gate (+Inf until enough requests are seen)",
            labels=["priority"])
        for klass, name in enumerate(gate.objectives.CLASSES):
            bound.add_metric([name], gate.tolerance.bound(klass))
        yield from (margin, waiting, bound)


class RebalanceCollector(Collector):
    """What the pressure model says each role needs (for HPA/KEDA, docs/ROLE_SWITCH.md)."""

    def __init__(self, figures) -> None:
        self.figures = figures

    def collect(self) -> Iterable:
        figures = self.figures()
        desired = GaugeMetricFamily(
            "gateway_desired_servers", "Servers each role needs to stand at 75% of its "
            "pressure (prefill queue/busy, decode slots/KV/ITL against the objectives)",
            labels=["model", "role"])
        pressure = GaugeMetricFamily(
            "gateway_role_pressure", "Each role's pressure (1: at its limit)",
            labels=["model", "role"])
        for (model, role), value in figures["desired"].items():
            desired.add_metric([model, role], value)
        for (model, role), value in figures["pressure"].items():
            pressure.add_metric([model, role], value)
        yield desired
        yield pressure


class SchedulerCollector(Collector):
    """Quarantined pairs, read from the scheduler at scrape time."""

    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler

    def collect(self) -> Iterable[GaugeMetricFamily]:
        quarantined = GaugeMetricFamily(
            "gateway_pair_quarantined", "1 while a (prefill, decode) pair is quarantined",
            labels=["prefill", "decode"])
        for prefill, decode in self.scheduler.pairs.quarantined():
            quarantined.add_metric([prefill, decode], 1)
        yield quarantined


class PoolCollector(Collector):
    """Per-server gauges read from the pool at scrape time."""

    def __init__(self, pool: ServerPool) -> None:
        self.pool = pool

    def collect(self) -> Iterable[GaugeMetricFamily]:
        labels = ["server", "role"]
        in_flight = GaugeMetricFamily("gateway_server_in_flight_requests",
                                      "Requests in flight per server", labels=labels)
        tokens = GaugeMetricFamily("gateway_server_in_flight_tokens",
                                   "Prompt tokens in flight per server", labels=labels)
        healthy = GaugeMetricFamily("gateway_server_healthy",
                                    "1 when health checks pass", labels=labels)
        usable = GaugeMetricFamily("gateway_server_usable",
                                   "1 when the server takes new requests", labels=labels)
        breaker = GaugeMetricFamily("gateway_server_breaker_state",
                                    "Circuit breaker: 0 closed, 1 half-open, 2 open",
                                    labels=labels)
        queue = GaugeMetricFamily("gateway_server_queued_requests",
                                  "Waiting requests reported by the server's /v1/loads",
                                  labels=labels)
        usage = GaugeMetricFamily("gateway_server_token_usage",
                                  "KV cache token usage reported by the server", labels=labels)
        usable_count = GaugeMetricFamily("gateway_usable_servers",
                                         "Usable servers per role", labels=["role"])
        counts = {"prefill": 0, "decode": 0}
        for w in self.pool:
            key = [w.url, w.role]
            requests, prompt_tokens = w.totals()
            in_flight.add_metric(key, requests)
            tokens.add_metric(key, prompt_tokens)
            healthy.add_metric(key, 1 if w.healthy else 0)
            is_usable = w.usable_now
            usable.add_metric(key, 1 if is_usable else 0)
            counts[w.role] += 1 if is_usable else 0
            breaker.add_metric(key, breaker_state_code(w.breaker.state))
            queue.add_metric(key, w.load.waiting)
            usage.add_metric(key, w.load.token_usage)
        for role, count in counts.items():
            usable_count.add_metric([role], count)
        yield from (in_flight, tokens, healthy, usable, breaker, queue, usage, usable_count)
