"""Backend server lists in the config: URLs, bootstrap ports, and the file form of both.

`--prefill URL[,URL...] [BOOTSTRAP_PORT]` and `--decode URL[,URL...]` are the command line's own
syntax (a port belongs to the URL before it), so they are parsed here rather than by the
typed-settings layer in `config.py`.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

SCHEMES = ("http", "https")


class ConfigError(ValueError):
    """A configuration problem, reported before the port is bound (exit code 2)."""


@dataclass(frozen=True)
class ServerSpec:
    """A backend server given on the command line, file or discovery."""

    url: str
    role: str  # "prefill" | "decode"
    bootstrap_port: int | None = None  # prefill only; None = read from /server_info
    model: str | None = None  # the model it serves; None = read from /server_info


def split_list(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def validate_url(url: str) -> str:
    """Check a backend URL and return it without a trailing slash."""
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # e.g. brackets around what is not an IPv6 address
        raise ConfigError(f"bad server URL {url!r}: {exc}") from None
    if parts.scheme not in SCHEMES or not parts.hostname:
        raise ConfigError(f"bad server URL {url!r}: expected http(s)://host:port")
    try:
        _ = parts.port
    except ValueError as exc:
        raise ConfigError(f"bad server URL {url!r}: {exc}") from exc
    if parts.path not in ("", "/") or parts.query or parts.fragment or "@" in parts.netloc:
        raise ConfigError(f"bad server URL {url!r}: no path, query, fragment or user allowed")
    return url.rstrip("/")


def parse_port(token: str, url: str) -> int | None:
    if token.lower() in ("none", "null", "auto"):
        return None
    try:
        port = int(token)
    except ValueError:
        raise ConfigError(f"bad bootstrap port {token!r} after {url}") from None
    if not 0 < port < 65536:
        raise ConfigError(f"bootstrap port {port} after {url} is out of range 1..65535")
    return port


def parse_prefill_tokens(groups: list[list[str]]) -> list[ServerSpec]:
    """`--prefill URL[,URL...] [PORT]` groups -> specs; a port applies to the URL before it."""
    specs: list[ServerSpec] = []
    for group in groups:
        pending = False
        for token in group:
            if "://" in token:
                for url in split_list(token):
                    specs.append(ServerSpec(validate_url(url), "prefill"))
                    pending = True
            elif pending:
                last = specs[-1]
                specs[-1] = dataclasses.replace(last, bootstrap_port=parse_port(token, last.url))
                pending = False
            else:
                raise ConfigError(f"--prefill: {token!r} is not a URL")
    return specs


def parse_decode_tokens(groups: list[list[str]]) -> list[ServerSpec]:
    specs = []
    for group in groups:
        for token in group:
            if "://" not in token:
                raise ConfigError(f"--decode: {token!r} is not a URL")
            specs.extend(ServerSpec(validate_url(u), "decode") for u in split_list(token))
    return specs


def servers_from_file(items: Any, role: str) -> list[ServerSpec]:
    """File form: a list of URLs, or of {url, bootstrap_port, model} maps."""
    if items is not None and not isinstance(items, list):
        raise ConfigError(f"{role}: expected a list of servers")
    specs = []
    for item in items or []:
        if isinstance(item, str):
            specs.append(ServerSpec(validate_url(item), role))
        elif isinstance(item, dict) and isinstance(item.get("url"), str):
            port = item.get("bootstrap_port")
            port = parse_port(str(port), item["url"]) if port is not None else None
            model = item.get("model")
            if model is not None and (not isinstance(model, str) or not model):
                raise ConfigError(f"{role}: 'model' of {item['url']} must be a name")
            specs.append(ServerSpec(validate_url(item["url"]), role,
                                    port if role == "prefill" else None, model))
        else:
            raise ConfigError(f"{role}: each entry must be a URL or a map with 'url'")
    return specs


def load_file(path: str) -> dict:
    """A YAML or TOML settings file as a flat mapping (dashes in keys become underscores)."""
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


def read_lines(path: str, what: str) -> tuple[str, ...]:
    """Non-empty, non-comment lines of a file (API keys, one per line)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} file {path}: {exc}") from exc
    return tuple(line.strip() for line in lines if line.strip() and not line.startswith("#"))
