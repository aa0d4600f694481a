"""One typed, frozen configuration built from flags, a YAML/TOML file and GATEWAY_* env.

Precedence: defaults < config file < environment < command-line flags. Every field is
declared once in `GatewayConfig` with its help text in the field metadata; the CLI parser is
generated from the fields so flags cannot drift from the config. This is the only module that
reads `os.environ`.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from gateway.discovery.incluster import in_cluster_settings

EXIT_CONFIG_ERROR = 2
EXIT_STARTUP_FAILURE = 3
ENV_PREFIX = "GATEWAY_"


class ConfigError(ValueError):
    """A configuration problem, reported before the port is bound (exit code 2)."""


@dataclass(frozen=True)
class ServerSpec:
    """A backend server given on the command line, file or discovery."""

    url: str
    role: str  # "prefill" | "decode"
    bootstrap_port: int | None = None  # prefill only; None = read from /server_info


def _opt(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass(frozen=True)
class GatewayConfig:
    """Every setting of the gateway. Field metadata `help` becomes the flag's help."""

    prefill: tuple[ServerSpec, ...] = _opt((), "prefill servers", cli=False)
    decode: tuple[ServerSpec, ...] = _opt((), "decode servers", cli=False)
    host: str = _opt("127.0.0.1", "address to listen on")
    port: int = _opt(8000, "port to listen on")
    log_level: str = _opt("warning", "log level (debug, info, warning, error)")

    # Scheduling
    policy: str | None = _opt(
        None, "policy for both roles (default: cache_aware for prefill, least_load for decode)")
    prefill_policy: str | None = _opt(None, "policy for choosing the prefill server")
    decode_policy: str | None = _opt(None, "policy for choosing the decode server")
    policy_options: dict | None = _opt(
        None, "JSON object of per-policy options, keyed by policy name", kind="json"
    )

    # Upstream HTTP
    connect_timeout: float = _opt(5.0, "seconds to connect to a backend server")
    response_timeout: float = _opt(
        600.0, "seconds to wait for a non-streaming answer or a stream's first byte"
    )
    stream_idle_timeout: float = _opt(120.0, "seconds allowed between two streamed chunks")
    request_timeout: float = _opt(1800.0, "total deadline of one request, retries included")
    max_connections: int = _opt(1024, "control-path (httpx) connection pool size")
    upstream_client: str = _opt("fast", "data-path HTTP client: fast (built-in), aiohttp, httpx")
    upstream_max_connections: int = _opt(512, "data-path connections per server; more legs wait")
    upstream_pool_timeout: float = _opt(30.0, "seconds a leg may wait for a free connection")
    upstream_ca_file: str | None = _opt(None, "CA bundle for https servers (default: system's)")
    upstream_insecure: bool = _opt(False, "do not verify https servers' certificates (unsafe)")
    probe_timeout: float = _opt(10.0, "seconds for startup probes of /server_info")
    skip_probe: bool = _opt(False, "do not probe servers at startup (bootstrap port 8998)")

    # Retries
    max_attempts: int = _opt(3, "attempts per request (1 = no retry), each with a new pair")
    retry_backoff: float = _opt(0.05, "first retry delay in seconds (doubles, with jitter)")
    retry_backoff_max: float = _opt(1.0, "cap of the retry delay in seconds")

    # Health and circuit breaking
    health_interval: float = _opt(5.0, "seconds between health checks of each server")
    health_timeout: float = _opt(5.0, "seconds before a health check counts as failed")
    health_endpoint: str = _opt("/health", "path probed on each server")
    health_failures: int = _opt(2, "consecutive failed checks that mark a server down")
    health_successes: int = _opt(1, "consecutive good checks that mark a server up")
    breaker_failures: int = _opt(5, "consecutive request failures that open a server's breaker")
    breaker_cooldown: float = _opt(10.0, "seconds an open breaker waits before a probe")
    loads_interval: float = _opt(2.0, "seconds between /v1/loads polls (0 = off)")

    # Admission and limits
    max_body_bytes: int = _opt(32 * 1024 * 1024, "largest accepted request body")
    max_items: int = _opt(1024, "largest batch size x n of one request (each item is a room)")
    max_concurrency: int = _opt(0, "requests served at once (0 = unlimited)")
    max_queue: int = _opt(256, "requests waiting for a slot before 429")
    queue_timeout: float = _opt(30.0, "seconds a request may wait for a slot before 503")
    api_keys: tuple[str, ...] = _opt(
        (), "API keys accepted on inference routes (comma-separated)", kind="list",
        aliases=("--api-key",))
    api_key_file: str | None = _opt(None, "file with one API key per line")
    admin_api_keys: tuple[str, ...] = _opt((), "API keys accepted on admin routes", kind="list")
    rate_limit: float = _opt(0.0, "requests/s allowed per API key (0 = unlimited)")
    rate_burst: int = _opt(20, "requests a key may send at once above its rate")
    shutdown_grace: float = _opt(30.0, "seconds to finish in-flight requests on SIGTERM")

    # Identity
    replica_id: int | None = _opt(
        None, "gateway replica id (0..4095) in every bootstrap room; default: POD_NAME's "
        "ordinal or hash, else random at start"
    )
    model: str | None = _opt(None, "served model name reported when servers do not say")

    # Launching a local cluster
    launch: bool = _opt(False, "launch a local cluster (simulated by default) and serve it")
    backend: str = _opt("sim", "backend to launch: sim or sglang")
    launch_config: str | None = _opt(None, "launcher topology file (YAML/TOML)")
    num_prefill: int = _opt(1, "prefill servers to launch")
    num_decode: int = _opt(2, "decode servers to launch")

    # Kubernetes discovery (gateway/discovery/, docs/DEPLOY.md): a selector turns it on
    prefill_selector: str | None = _opt(None, "label selector of prefill pods (Kubernetes)")
    decode_selector: str | None = _opt(None, "label selector of decode pods (Kubernetes)")
    namespace: str | None = _opt(None, "namespace of the SGLang pods (default: the gateway's)")
    k8s_api_server: str | None = _opt(None, "Kubernetes API URL (default: in-cluster)")
    k8s_token_file: str | None = _opt(None, "file with the API bearer token (re-read)")
    k8s_ca_file: str | None = _opt(None, "CA bundle of the Kubernetes API")
    k8s_worker_port: int = _opt(30000, "port of pods without sglang.ai/port or an http port")
    k8s_model_label: str = _opt("sglang.ai/model", "pod label (or annotation) naming the model")
    k8s_drain_timeout: float = _opt(60.0, "seconds a leaving pod's requests may take")


def split_url_list(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def validate_url(url: str) -> str:
    """Check a backend URL and return it without a trailing slash."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"bad server URL {url!r}: expected http(s)://host:port")
    try:
        _ = parts.port
    except ValueError as exc:
        raise ConfigError(f"bad server URL {url!r}: {exc}") from exc
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError(f"bad server URL {url!r}: no path, query or fragment allowed")
    return url.rstrip("/")


def _parse_port(token: str, url: str) -> int | None:
    if token.lower() in ("none", "null", "auto"):
        return None
    try:
        port = int(token)
    except ValueError:
        raise ConfigError(f"bad bootstrap port {token!r} after {url}") from None
    if not 0 < port < 65536:
        raise ConfigError(f"bootstrap port {port} after {url} is out of range")
    return port


def parse_prefill_tokens(groups: list[list[str]]) -> list[ServerSpec]:
    """`--prefill URL[,URL...] [PORT]` groups -> specs; a port applies to the URL before it."""
    specs: list[ServerSpec] = []
    for group in groups:
        pending: list[str] = []
        for token in group:
            if "://" in token:
                for url in split_url_list(token):
                    specs.append(ServerSpec(validate_url(url), "prefill"))
                    pending = [url]
            elif pending:
                last = specs[-1]
                specs[-1] = dataclasses.replace(last, bootstrap_port=_parse_port(token, last.url))
                pending = []
            else:
                raise ConfigError(f"--prefill: {token!r} is not a URL")
    return specs


def parse_decode_tokens(groups: list[list[str]]) -> list[ServerSpec]:
    specs = []
    for group in groups:
        for token in group:
            if "://" not in token:
                raise ConfigError(f"--decode: {token!r} is not a URL")
            specs.extend(ServerSpec(validate_url(u), "decode") for u in split_url_list(token))
    return specs


def _servers_from_file(items: Any, role: str) -> list[ServerSpec]:
    """File form: a list of URLs, or of {url, bootstrap_port} maps."""
    specs = []
    for item in items or []:
        if isinstance(item, str):
            specs.append(ServerSpec(validate_url(item), role))
        elif isinstance(item, dict) and "url" in item:
            port = item.get("bootstrap_port")
            port = _parse_port(str(port), item["url"]) if port is not None else None
            specs.append(ServerSpec(validate_url(item["url"]), role, port if role == "prefill" else None))
        else:
            raise ConfigError(f"{role}: each entry must be a URL or a map with 'url'")
    return specs


def load_file(path: str) -> dict:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    try:
        data = tomllib.loads(text) if p.suffix == ".toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"config file {path} is not valid: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of settings")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


_FIELDS = {f.name: f for f in dataclasses.fields(GatewayConfig)}


def _coerce(name: str, value: Any) -> Any:
    """Turn a file/env/flag value into the field's type, naming the key on failure."""
    f = _FIELDS[name]
    kind = f.metadata.get("kind")
    default = f.default
    try:
        if kind == "json":
            value = json.loads(value) if isinstance(value, str) else value
            if not isinstance(value, dict):
                raise ValueError("expected a JSON object")
            return value
        if kind == "list":
            if isinstance(value, str):
                return tuple(split_url_list(value))
            return tuple(str(v) for v in value)
        if isinstance(default, bool):
            if isinstance(value, str):
                if value.lower() in ("1", "true", "yes", "on"):
                    return True
                if value.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError("expected a boolean")
            return bool(value)
        if value is None:
            return None
        if isinstance(default, int) or name in ("replica_id",):
            return int(value)
        if isinstance(default, float):
            return float(value)
        return str(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"setting {name!r}: bad value {value!r} ({exc})") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gateway", allow_abbrev=False,
        description="PD-disaggregation gateway for SGLang prefill and decode servers.",
    )
    parser.add_argument(
        "--prefill", nargs="+", action="append", default=[], metavar="URL [BOOTSTRAP_PORT]",
        help="prefill server URL(s), comma-separated or repeated, each optionally "
        "followed by its bootstrap port (read from /server_info when omitted)",
    )
    parser.add_argument(
        "--decode", nargs="+", action="append", default=[], metavar="URL",
        help="decode server URL(s), comma-separated or repeated",
    )
    parser.add_argument("--config", help="YAML or TOML file with the same settings")
    for f in dataclasses.fields(GatewayConfig):
        if not f.metadata.get("cli", True):
            continue
        flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
        if isinstance(f.default, bool):
            parser.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction,
                                default=None, help=f.metadata["help"])
        else:
            parser.add_argument(*flags, dest=f.name, default=None, help=f.metadata["help"])
    return parser


def _validate(cfg: GatewayConfig) -> None:
    from gateway.policies import REGISTRY  # noqa: PLC0415  (registry imports no config)

    if not cfg.launch and (not (cfg.prefill or cfg.prefill_selector)
                           or not (cfg.decode or cfg.decode_selector)):
        raise ConfigError(
            "at least one prefill and one decode server are needed: "
            "--prefill URL [BOOTSTRAP_PORT] --decode URL, --prefill-selector and "
            "--decode-selector (Kubernetes), or --launch"
        )
    if (cfg.prefill_selector or cfg.decode_selector) and not cfg.k8s_api_server:
        raise ConfigError("Kubernetes discovery needs --k8s-api-server outside a pod")
    for name in ("policy", "prefill_policy", "decode_policy"):
        value = getattr(cfg, name)
        if value is not None and value not in REGISTRY:
            raise ConfigError(f"{name} {value!r} is unknown; choose one of {sorted(REGISTRY)}")
    for key in cfg.policy_options or {}:
        if key not in REGISTRY:
            raise ConfigError(f"policy_options: no policy named {key!r}")
    if not 0 < cfg.port < 65536:
        raise ConfigError(f"port {cfg.port} is out of range")
    if cfg.replica_id is not None and not 0 <= cfg.replica_id < 4096:
        raise ConfigError("replica_id must be in 0..4095")
    if cfg.max_items < 1:
        raise ConfigError("max_items must be at least 1")
    if cfg.max_attempts < 1:
        raise ConfigError("max_attempts must be at least 1")
    if cfg.upstream_client not in ("fast", "aiohttp", "httpx"):
        raise ConfigError("upstream_client must be 'fast', 'aiohttp' or 'httpx'")
    if cfg.backend not in ("sim", "sglang"):
        raise ConfigError("backend must be 'sim' or 'sglang'")
    for name in ("connect_timeout", "response_timeout", "stream_idle_timeout",
                 "request_timeout", "health_interval", "health_timeout"):
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"{name} must be positive")
    urls = [s.url for s in cfg.prefill + cfg.decode]
    dupes = {u for u in urls if urls.count(u) > 1}
    if dupes:
        raise ConfigError(f"server listed twice: {', '.join(sorted(dupes))}")
    try:
        ipaddress.ip_address(cfg.host.strip("[]"))
    except ValueError:
        if not cfg.host or " " in cfg.host:
            raise ConfigError(f"bad listen host {cfg.host!r}") from None


def load_config(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> GatewayConfig:
    """Build and validate the config; raises ConfigError (argparse exits 2 on bad flags)."""
    environ = os.environ if environ is None else environ
    args = build_parser().parse_args(argv)
    values: dict[str, Any] = {}
    file_prefill: list[ServerSpec] = []
    file_decode: list[ServerSpec] = []
    if args.config:
        data = load_file(args.config)
        file_prefill = _servers_from_file(data.pop("prefill", None), "prefill")
        file_decode = _servers_from_file(data.pop("decode", None), "decode")
        for key, value in data.items():
            if key not in _FIELDS or not _FIELDS[key].metadata.get("cli", True):
                raise ConfigError(f"config file {args.config}: unknown setting {key!r}")
            values[key] = _coerce(key, value)
    for name in _FIELDS:
        env_value = environ.get(ENV_PREFIX + name.upper())
        if env_value is not None and _FIELDS[name].metadata.get("cli", True):
            values[name] = _coerce(name, env_value)
    for name in _FIELDS:
        flag_value = getattr(args, name, None)
        if flag_value is not None and _FIELDS[name].metadata.get("cli", True):
            values[name] = _coerce(name, flag_value)
    prefill = parse_prefill_tokens(args.prefill) or file_prefill
    decode = parse_decode_tokens(args.decode) or file_decode
    if (values.get("prefill_selector") or values.get("decode_selector")) \
            and not values.get("k8s_api_server"):
        for key, value in in_cluster_settings(environ).items():
            values[key] = values.get(key) or value
    if values.get("replica_id") is None:
        values["replica_id"] = replica_id_from_pod_name(environ.get("POD_NAME"))
    if values.get("api_key_file"):
        values["api_keys"] = tuple(values.get("api_keys", ())) + read_key_file(values["api_key_file"])
    cfg = GatewayConfig(prefill=tuple(prefill), decode=tuple(decode), **values)
    _validate(cfg)
    return cfg


def read_key_file(path: str) -> tuple[str, ...]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read api key file {path}: {exc}") from exc
    return tuple(line.strip() for line in lines if line.strip() and not line.startswith("#"))


def replica_id_from_pod_name(name: str | None) -> int | None:
    """StatefulSet pods end in an ordinal (`gw-3`); other names hash to an id in 0..4095.

    Only used when no --replica-id is given; a Deployment's random pod suffixes hash, which is
    collision-prone, so the Kubernetes manifests pass the id explicitly (see docs/DEPLOY.md).
    """
    if not name:
        return None
    tail = name.rsplit("-", 1)[-1]
    if tail.isdigit() and int(tail) < 4096:
        return int(tail)
    import zlib  # noqa: PLC0415

    return zlib.crc32(name.encode()) % 4096
