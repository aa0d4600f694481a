"""One typed, frozen configuration built from flags, a YAML/TOML file and GATEWAY_* env.

Precedence: defaults < config file < environment < command-line flags. Every setting is
declared once in `GatewayConfig` (`schema.py`), and the CLI parser is generated from its
fields so flags cannot drift from the config. A bad value exits 2 naming the setting and what
it allows, before the port is bound. This is the only module that reads `os.environ`.

Why pydantic and not pydantic-settings: the typed checks are what we need from a library;
the sources (file, env, flags) and their precedence are a few lines here, and the server
lists use a syntax of their own (`--prefill URL [PORT]`) that a settings library would not
parse for us anyway.
"""

from __future__ import annotations

import dataclasses
import json
import os
import typing
import zlib
from typing import Any

import pydantic

from gateway.config.flags import build_parser, describe_error
from gateway.config.rules import validate
from gateway.config.schema import GatewayConfig
from gateway.config.servers import (
    ConfigError,
    ServerSpec,
    load_file,
    parse_decode_tokens,
    parse_prefill_tokens,
    read_lines,
    servers_from_file,
    split_list,
)
from gateway.config.tenants import key_and_tenant
from gateway.discovery.incluster import in_cluster_settings

__all__ = ["ConfigError", "GatewayConfig", "ServerSpec", "load_config"]

EXIT_CONFIG_ERROR = 2
EXIT_STARTUP_FAILURE = 3
ENV_PREFIX = "GATEWAY_"


_FIELDS = {f.name: f for f in dataclasses.fields(GatewayConfig)}
_HINTS = typing.get_type_hints(GatewayConfig, include_extras=True)
_CLI_FIELDS = [f for f in dataclasses.fields(GatewayConfig) if f.metadata.get("cli", True)]


def _raw(name: str, value: Any) -> Any:
    """Pre-shape the values a string cannot carry as is: lists and JSON objects. Everything
    else (ints, floats, booleans, choices) is converted and checked by pydantic."""
    kind = _FIELDS[name].metadata.get("kind")
    if kind == "json" and isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError as exc:
            raise ConfigError(f"setting {name!r}: not valid JSON ({exc})") from None
    if kind == "list" and isinstance(value, str):
        return tuple(split_list(value))
    if isinstance(value, str) and value.lower() in ("none", "null") and _FIELDS[name].default is None:
        return None
    return value


def _construct(values: dict[str, Any], prefill: list[ServerSpec],
               decode: list[ServerSpec]) -> GatewayConfig:
    try:
        return GatewayConfig(prefill=tuple(prefill), decode=tuple(decode), **values)
    except pydantic.ValidationError as exc:
        raise ConfigError("; ".join(describe_error(e, _HINTS) for e in exc.errors())) from None


def load_config(argv: list[str] | None = None,
                environ: dict[str, str] | None = None) -> GatewayConfig:
    """Build and validate the config; raises ConfigError (argparse exits 2 on bad flags)."""
    environ = os.environ if environ is None else environ
    args = build_parser(_CLI_FIELDS, _HINTS).parse_args(argv)
    values: dict[str, Any] = {}
    file_prefill: list[ServerSpec] = []
    file_decode: list[ServerSpec] = []
    if args.config:
        data = load_file(args.config)
        file_prefill = servers_from_file(data.pop("prefill", None), "prefill")
        file_decode = servers_from_file(data.pop("decode", None), "decode")
        for key, value in data.items():
            if key not in _FIELDS or not _FIELDS[key].metadata.get("cli", True):
                raise ConfigError(f"config file {args.config}: unknown setting {key!r}")
            values[key] = _raw(key, value)
    for f in _CLI_FIELDS:
        env_value = environ.get(ENV_PREFIX + f.name.upper())
        if env_value is not None:
            values[f.name] = _raw(f.name, env_value)
    for f in _CLI_FIELDS:
        flag_value = getattr(args, f.name, None)
        if flag_value is not None:
            values[f.name] = _raw(f.name, flag_value)
    prefill = parse_prefill_tokens(args.prefill) or file_prefill
    decode = parse_decode_tokens(args.decode) or file_decode
    if (values.get("prefill_selector") or values.get("decode_selector")) \
            and not values.get("k8s_api_server"):
        for key, value in in_cluster_settings(environ).items():
            values[key] = values.get(key) or value
    if values.get("replica_id") is None:
        values["replica_id"] = replica_id_from_pod_name(environ.get("POD_NAME"))
    tenants = ["default"] * len(values.get("api_keys", ()))
    for keys, path in (("api_keys", "api_key_file"), ("admin_api_keys", "admin_api_key_file")):
        if values.get(path):
            lines = read_lines(values[path], "API key")
            if not lines:  # an empty Secret would silently leave the routes open
                raise ConfigError(f"setting {path!r}: {values[path]} holds no key")
            pairs = [key_and_tenant(line, path) for line in lines]
            values[keys] = tuple(values.get(keys, ())) + tuple(key for key, _ in pairs)
            if keys == "api_keys":
                tenants += [tenant for _, tenant in pairs]
    values["api_key_tenants"] = tuple(tenants)
    cfg = _construct(values, prefill, decode)
    validate(cfg)
    return cfg


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
    return zlib.crc32(name.encode()) % 4096
