"""Every setting of the gateway, declared once: `GatewayConfig`.

A field's type carries its range or choice set (pydantic checks them and turns the strings of
flags and env into ints, floats and booleans); its metadata carries the help text, from which
the CLI parser is generated. Apart from `settings.py` (the sources and their precedence) so
that the config rules (`rules.py`, `models.py`) can name the type without importing the loader
that runs them.
"""

from __future__ import annotations

from dataclasses import field
from typing import Annotated, Any, Literal

import pydantic
from pydantic import Field
from pydantic.dataclasses import dataclass

from gateway.config.servers import ServerSpec
from gateway.config.tenants import TenantSettings
from gateway.slo.objectives import SloClass

Seconds = Annotated[float, Field(gt=0, le=86400)]
OptionalSeconds = Annotated[float, Field(ge=0, le=86400)]  # 0 turns the feature off
Port = Annotated[int, Field(gt=0, lt=65536)]
Count = Annotated[int, Field(ge=1, le=1_000_000)]
OptionalCount = Annotated[int, Field(ge=0, le=1_000_000)]  # 0: unlimited / off
Bytes = Annotated[int, Field(ge=1024, le=1 << 34)]
# a DNS name (letters, digits, '-', '_', dots; no port, no scheme, no wildcard)
HostName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_]([A-Za-z0-9_.-]{0,251}[A-Za-z0-9_.])?$")]
OTLP_URL = r"^https?://[^\s/?#]+(/[^\s?#]*)?$"  # a collector: scheme, host[:port], path


def _opt(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass(frozen=True, config=pydantic.ConfigDict(extra="forbid"))
class GatewayConfig:
    """Every setting of the gateway. Field metadata `help` becomes the flag's help."""

    prefill: tuple[ServerSpec, ...] = _opt((), "prefill servers", cli=False)
    decode: tuple[ServerSpec, ...] = _opt((), "decode servers", cli=False)
    host: str = _opt("127.0.0.1", "address to listen on")
    port: Port = _opt(8000, "port to listen on")
    log_level: Literal["debug", "info", "warning", "error", "critical"] = _opt(
        "warning", "log level")
    access_log: str | None = _opt(
        None, "write one JSON line per inference request to this file ('-': standard output): "
        "tenant, model, pair, status, times, tokens (docs/TENANCY.md, 'Usage accounting'); "
        "off by default")

    # TLS for clients (docs/SECURITY.md)
    ssl_certfile: str | None = _opt(None, "serve HTTPS with this certificate (PEM)")
    ssl_keyfile: str | None = _opt(None, "private key of --ssl-certfile (PEM)")
    ssl_ca_certs: str | None = _opt(
        None, "CA bundle of client certificates; when set, clients must present one (mTLS)")

    # Serving processes (gateway/processes/supervisor.py, docs/WORKERS.md)
    workers: Literal["auto"] | Annotated[int, Field(ge=1, le=32)] = _opt(
        1, "serving processes on the one port; auto: one per core this process may use")
    workers_socket: Literal["shared", "reuseport"] = _opt(
        "shared", "how workers share the port: one socket the supervisor binds, or one "
        "SO_REUSEPORT socket each")

    # Client connections (gateway/routes/server_protocol.py)
    max_client_connections: OptionalCount = _opt(
        0, "client connections and requests one serving process (each of --workers) serves "
        "at once before new ones get 503 (0 = from the open-file limit: a third of it, each "
        "request may hold two upstream connections)")
    head_timeout: Seconds = _opt(
        10.0, "seconds a client has to send a request's headers (slowloris)")
    body_timeout: Seconds = _opt(60.0, "seconds a client has to send a request's body")
    keep_alive_timeout: Seconds = _opt(
        75.0, "seconds an idle kept-alive client connection stays open: above clients' own "
        "pool expiry (httpx, the OpenAI SDKs: 5 s) and load balancers' idle timeout (60 s), "
        "so that a client never reuses a connection the gateway is closing")
    max_header_count: Annotated[int, Field(ge=8, le=1000)] = _opt(
        100, "most headers a request may carry (more: 431)")
    max_header_bytes: Annotated[int, Field(ge=1024, le=1 << 20)] = _opt(
        32 * 1024, "most bytes of URL and headers a request may carry (more: 431)")

    # Scheduling
    policy: str | None = _opt(
        None, "policy for both roles (default: auto: cache_aware for prefill and least_load "
        "for decode; with latency objectives, the SLO model's decode and admission gate)")
    prefill_policy: str | None = _opt(None, "policy for choosing the prefill server")
    decode_policy: str | None = _opt(None, "policy for choosing the decode server")
    policy_options: dict | None = _opt(
        None, "JSON object of per-policy options, keyed by policy name", kind="json")

    # Upstream HTTP
    connect_timeout: Seconds = _opt(5.0, "seconds to connect to a backend server")
    response_timeout: Seconds = _opt(
        600.0, "seconds to wait for a non-streaming answer or a stream's first byte")
    stream_idle_timeout: Seconds = _opt(120.0, "seconds allowed between two streamed chunks")
    send_timeout: Seconds = _opt(
        30.0, "seconds a client may take to accept one streamed chunk; a client that stops "
        "reading longer loses its stream and both legs are aborted")
    request_timeout: Seconds = _opt(1800.0, "total deadline of one request, retries included")
    max_connections: Count = _opt(1024, "control-path (httpx) connection pool size")
    upstream_client: Literal["fast", "aiohttp", "httpx"] = _opt(
        "fast", "data-path HTTP client: fast (built-in, measured fastest), aiohttp, httpx")
    upstream_max_connections: Annotated[int, Field(ge=1, le=65536)] = _opt(
        512, "data-path connections per server; more legs wait")
    upstream_pool_timeout: Seconds = _opt(30.0, "seconds a leg may wait for a free connection")
    upstream_ca_file: str | None = _opt(None, "CA bundle for https servers (default: system's)")
    upstream_insecure: bool = _opt(False, "do not verify https servers' certificates (unsafe)")
    probe_timeout: Seconds = _opt(10.0, "seconds for startup probes of /server_info")
    skip_probe: bool = _opt(False, "do not probe servers at startup (bootstrap port 8998)")

    # Hang detection (gateway/health/deadlines.py; docs/RELIABILITY.md says how defaults were chosen)
    hang_factor: Annotated[float, Field(ge=1, le=100)] = _opt(
        4.0, "a server is suspected hung after this many times its usual latency "
        "(the --hang-percentile of its first progress per prompt size, and of its stream gaps)")
    hang_percentile: Annotated[float, Field(ge=0.5, le=1)] = _opt(
        0.99, "which percentile of a server's observed latency counts as usual")
    hang_floor: Annotated[float, Field(gt=0, le=3600)] = _opt(
        5.0, "seconds: never suspect a hang sooner than this")
    hang_cold: Annotated[float, Field(gt=0, le=3600)] = _opt(
        10.0, "seconds before suspecting a hang while nothing was learned yet (plus the "
        "prompt at 2000 tokens/s)")
    midstream_failover: bool = _opt(
        True, "continue a stream whose decode died on another pair (greedy: the same answer; "
        "sampled: another valid sample)")

    # Retries
    max_attempts: Annotated[int, Field(ge=1, le=20)] = _opt(
        5, "attempts per request (1 = no retry), each with a new pair; a rescue and a "
        "refused connection do not count")
    retry_backoff: Annotated[float, Field(ge=0, le=60)] = _opt(
        0.05, "first retry delay in seconds (doubles, with jitter)")
    retry_backoff_max: Annotated[float, Field(ge=0, le=600)] = _opt(
        1.0, "cap of the retry delay in seconds")

    # Health and circuit breaking
    health_interval: Seconds = _opt(2.0, "seconds between health checks of each server")
    health_timeout: Seconds = _opt(
        2.5, "seconds before a health check counts as failed (SGLang's /health takes about 1 s)")
    health_endpoint: Literal["/health", "/health_generate", "/ready", "/ping"] = _opt(
        "/health", "path probed on each server")
    health_failures: Annotated[int, Field(ge=1, le=100)] = _opt(
        2, "consecutive failed checks that mark a server down")
    health_successes: Annotated[int, Field(ge=1, le=100)] = _opt(
        1, "consecutive good checks that mark a server up")
    breaker_failures: Annotated[int, Field(ge=1, le=1000)] = _opt(
        5, "consecutive request failures that open a server's breaker")
    breaker_cooldown: Seconds = _opt(10.0, "seconds an open breaker waits before a probe")
    loads_interval: OptionalSeconds = _opt(2.0, "seconds between /v1/loads polls (0 = off)")

    # Automatic rebalancing (gateway/servers/rebalance.py, docs/ROLE_SWITCH.md): off by default
    rebalance: bool = _opt(
        False, "switch servers between prefill and decode by measured pressure (servers need "
        "--enable-pd-role-switch); gateway_desired_servers is published either way")
    rebalance_ttft_ms: Annotated[float, Field(gt=0, le=600_000)] = _opt(
        1500.0, "TTFT objective the prefill pressure is measured against, ms")
    rebalance_itl_ms: Annotated[float, Field(gt=0, le=60_000)] = _opt(
        60.0, "mean ITL objective the decode pressure is measured against, ms")
    rebalance_window: Annotated[float, Field(ge=1, le=3600)] = _opt(
        10.0, "seconds a pressure must hold before a switch")
    rebalance_cooldown: Annotated[float, Field(ge=0, le=86400)] = _opt(
        60.0, "seconds after a switch (or a failed one) before the next")
    rebalance_max_per_hour: Annotated[int, Field(ge=1, le=3600)] = _opt(
        6, "automatic switches allowed in any hour")
    rebalance_min_servers: Annotated[int, Field(ge=1, le=64)] = _opt(
        1, "servers each role keeps at least (per model)")

    # Admission and limits
    max_body_bytes: Bytes = _opt(32 * 1024 * 1024, "largest accepted request body")
    max_inflight_body_bytes: Bytes = _opt(
        256 * 1024 * 1024, "bytes of request bodies one serving process holds at once; a "
        "body beyond gets 503 with Retry-After (never below --max-body-bytes; "
        "docs/RELIABILITY.md, 'Large bodies')")
    max_items: Annotated[int, Field(ge=1, le=65536)] = _opt(
        1024, "largest batch size x n of one request (each item is a room)")
    max_concurrency: OptionalCount = _opt(0, "requests served at once (0 = unlimited)")
    max_queue: Annotated[int, Field(ge=0, le=1_000_000)] = _opt(
        256, "requests waiting for a slot before 429")
    queue_timeout: Seconds = _opt(30.0, "seconds a request may wait for a slot before 503")
    api_keys: tuple[str, ...] = _opt(
        (), "API keys accepted on inference routes (comma-separated; prefer "
        "--api-key-file or GATEWAY_API_KEYS: flags show in the process list)", kind="list",
        aliases=("--api-key",))
    api_key_file: str | None = _opt(
        None, "file with one inference API key per line, optionally followed by the name of "
        "its tenant (KEY TENANT; default tenant: 'default')")
    api_key_tenants: tuple[str, ...] = _opt(
        (), "the tenant of each inference key, in the order of api_keys", cli=False)
    admin_api_keys: tuple[str, ...] = _opt(
        (), "API keys for the admin API (server changes, flush, abort of any request, "
        "status data); without any, those routes answer only loopback clients", kind="list",
        aliases=("--admin-api-key",))
    admin_api_key_file: str | None = _opt(None, "file with one admin API key per line")
    allowed_hosts: tuple[HostName, ...] = _opt(
        (), "names besides 'localhost', --host and IP addresses that loopback clients may "
        "call this gateway by (the Host header) on admin and abort routes while no admin key "
        "is set: a DNS-rebinding guard (docs/SECURITY.md, 'Browsers'); inference takes any Host",
        kind="list", aliases=("--allowed-host",))
    allow_media_urls: bool = _opt(
        False, "let bodies name images, video and audio by http(s) URL, which the servers "
        "then fetch from inside the cluster (inline data: URIs are always taken; paths on "
        "the servers' disks never: docs/SECURITY.md, 'What a body may make the servers do')")
    allow_custom_logit_processor: bool = _opt(
        False, "let bodies carry `custom_logit_processor`, a pickled callable the servers run "
        "when started with --enable-custom-logit-processor: only for trusted callers")
    rate_limit: Annotated[float, Field(ge=0, le=1e6)] = _opt(
        0.0, "requests/s allowed per API key (0 = unlimited)")
    rate_burst: Annotated[int, Field(ge=1, le=1_000_000)] = _opt(
        20, "requests a key may send at once above its rate")
    rate_limit_tokens: Annotated[float, Field(ge=0, le=1e12)] = _opt(
        0.0, "prompt tokens per minute allowed per API key, up to a minute's worth at once "
        "(exact with --tokenizer or token-id prompts, else estimated; 0 = unlimited)")
    # Tenancy (gateway/admission/tenancy.py, docs/TENANCY.md): priorities, fairness, session affinity
    tenants: dict[str, TenantSettings] | None = _opt(
        None, "JSON object of per-tenant admission settings, {TENANT: {priority, max_priority, "
        "weight}} (classes: interactive, standard, batch; '*': every tenant not listed)",
        kind="json")
    slo_classes: dict[Literal["interactive", "standard", "batch"], SloClass] | None = _opt(
        None, "JSON object of latency objectives per priority class, {CLASS: {ttft_ms, "
        "itl_ms, on_miss: queue|shed|best_effort}}; headers x-slo-ttft-ms and x-slo-itl-ms "
        "set a request's own (docs/SCHEDULING.md); default: none (best effort)", kind="json")
    priority_header: str = _opt(
        "x-priority", "request header naming the request's priority class, capped by its "
        "tenant's max_priority ('' = off)")
    deadline_header: str = _opt(
        "x-request-timeout", "request header with the seconds the client will wait; no work "
        "starts once they are over ('' = off)")
    forward_priority: Literal["auto", "on", "off"] = _opt(
        "auto", "send the class to SGLang as `priority`: auto (servers whose /server_info says "
        "enable_priority_scheduling), on (every server), off (bodies pass as sent)")
    session_header: str | None = _opt(
        None, "request header naming a conversation; its requests keep their prefill server "
        "while it is usable and not overloaded (unset = off)")
    session_capacity: Count = _opt(
        100_000, "sessions each serving process remembers (least recently used go first)")
    session_ttl: Seconds = _opt(1800.0, "seconds a session's prefill choice is remembered")
    info_cache_ttl: OptionalSeconds = _opt(
        5.0, "seconds an answer of /health_generate, /server_info, /v1/models or /model_info "
        "is reused, so callers cannot make the servers work per call (0 = shared only while "
        "one is being computed)")
    shutdown_grace: OptionalSeconds = _opt(30.0, "seconds to finish in-flight requests on SIGTERM")

    # Tracing (gateway/observability/tracing.py, docs/TRACING.md): OpenTelemetry spans, off unless an endpoint
    otlp_endpoint: Annotated[str, Field(pattern=OTLP_URL, max_length=2048)] | None = _opt(
        None, "OTLP collector URL; turns tracing on (http/protobuf: path default /v1/traces)")
    otlp_protocol: Literal["http/protobuf", "grpc"] = _opt("http/protobuf", "OTLP transport")
    otlp_sample_ratio: Annotated[float, Field(ge=0, le=1)] = _opt(
        1.0, "share of new traces recorded (a client's valid traceparent decides its own)")
    otlp_service_name: Annotated[str, Field(min_length=1, max_length=128)] = _opt(
        "pd-gateway", "service.name of the gateway's spans")

    # Identity
    replica_id: Annotated[int, Field(ge=0, le=4095)] | None = _opt(
        None, "gateway replica id (0..4095) in every bootstrap room; default: POD_NAME's "
        "ordinal or hash, else random at start")
    model: str | None = _opt(None, "model name of servers that report none (else 'default')")

    # Several models (gateway/scheduling/models.py, docs/TENANCY.md "Several models")
    default_model: str | None = _opt(
        None, "model of requests that name none (or 'default') when several are served")
    model_aliases: dict | None = _opt(
        None, "JSON object of other names of models: {alias: model}", kind="json")
    model_policies: dict | None = _opt(
        None, "JSON object of per-model policy settings: {model: {policy, prefill_policy, "
        "decode_policy, policy_options}} (default: the global ones)", kind="json")

    # Tokenizer (gateway/tokens/tokenizer.py): token ids for policies and checks that need them
    tokenizer: str | None = _opt(
        None, "the served model's tokenizer: a directory with tokenizer.json (and "
        "tokenizer_config.json, chat_template.jinja) or a tokenizer.json file; default: the "
        "tokenizer_path the servers report in /model_info, when it is readable here")
    tokenizer_threads: Annotated[int, Field(ge=1, le=32)] = _opt(
        2, "threads that tokenize long prompts off the event loop")

    # Responses state (gateway/responses/, docs/RESPONSES.md)
    responses_store: str | None = _opt(
        None, "where /v1/responses state is kept: a SQLite file path, or redis://host:port/db "
        "(shared by replicas and --workers); unset: memory (with --workers: a SQLite file the "
        "workers share, removed at exit)")
    responses_ttl: Annotated[float, Field(gt=0, le=366 * 86400)] = _opt(
        30 * 86400.0, "seconds a kept response stays (OpenAI keeps 30 days)")
    responses_max_count: Count = _opt(100_000, "responses kept at most (the oldest go first)")
    responses_max_bytes: Bytes = _opt(
        128 * 1024 * 1024, "bytes of kept responses at most (the oldest go first)")

    # Launching a local cluster
    launch: bool = _opt(False, "launch a local cluster (simulated by default) and serve it")
    backend: Literal["sim", "sglang"] = _opt("sim", "backend to launch: sim or sglang")
    launch_config: str | None = _opt(None, "launcher topology file (YAML/TOML)")
    num_prefill: Annotated[int, Field(ge=1, le=64)] = _opt(1, "prefill servers to launch")
    num_decode: Annotated[int, Field(ge=1, le=64)] = _opt(2, "decode servers to launch")

    # Kubernetes discovery (gateway/discovery/, docs/DEPLOY.md): a selector turns it on
    prefill_selector: str | None = _opt(None, "label selector of prefill pods (Kubernetes)")
    decode_selector: str | None = _opt(None, "label selector of decode pods (Kubernetes)")
    namespace: str | None = _opt(None, "namespace of the SGLang pods (default: the gateway's)")
    k8s_api_server: str | None = _opt(None, "Kubernetes API URL (default: in-cluster)")
    k8s_token_file: str | None = _opt(None, "file with the API bearer token (re-read)")
    k8s_ca_file: str | None = _opt(None, "CA bundle of the Kubernetes API")
    k8s_worker_port: Port = _opt(30000, "port of pods without sglang.ai/port or an http port")
    k8s_model_label: str = _opt("sglang.ai/model", "pod label (or annotation) naming the model")
    k8s_drain_timeout: OptionalSeconds = _opt(60.0, "seconds a leaving pod's requests may take")
