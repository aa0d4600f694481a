"""Secrets out of what the servers say before the gateway repeats it to callers.

`/server_info`, `/v1/models` and the model names the gateway lists come from the servers'
own arguments, which may hold API keys, tokens or a private hub's password in a model path;
`/server_info` also holds where the servers are (host, ports, `dist_init_addr`), which an
inference caller is not told either (`addresses=True`; an admin is).
"""

from __future__ import annotations

import re
from typing import Any

# Words that make a field a secret, matched as whole words of its name (snake_case, kebab-case
# or camelCase): `api_key`, `hf_token`, `ssl_keyfile_password`, `apiKey`; not
# `max_total_num_tokens`, `tokenizer_path` or `ssl_keyfile` (a path, not the key).
SECRET_WORDS = frozenset({"key", "apikey", "token", "secret", "password", "passwd",
                          "credential", "credentials", "auth", "authorization", "cookie"})
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_WORD = re.compile(r"[^A-Za-z0-9]+")
# user:password@ in URLs anywhere in a string value (e.g. a model path on a private hub)
_USERINFO = re.compile(r"(?<=://)[^/@\s]*:[^/@\s]*@")
REDACTED = "<redacted>"
# Words that make a field an address (whole words of its name, as above): `host`, `port`,
# `dist_init_addr`, `nccl_port`, `disaggregation_bootstrap_port`, `encoder_urls`,
# `otlp_traces_endpoint`; a string value with "://" in it is one too, whatever its name.
ADDRESS_WORDS = frozenset({"host", "hosts", "hostname", "port", "ports", "addr", "address",
                           "addresses", "url", "urls", "uri", "ip", "ips", "endpoint",
                           "endpoints"})


def _words(name: str) -> list[str]:
    return _WORD.split(_CAMEL.sub("_", name).lower())


def secret_name(name: str) -> bool:
    return any(word in SECRET_WORDS for word in _words(name))


def address_name(name: str) -> bool:
    return any(word in ADDRESS_WORDS for word in _words(name))


def redact(value: Any, addresses: bool = False) -> Any:
    """A copy of a JSON value with secret fields replaced (recursively): fields whose name
    holds a secret word and whose value could hold one (a non-empty string, list or object;
    None, booleans and numbers stay: they say "not set" or "on"), and passwords in URLs.
    `addresses`: address fields too (a port is a number: only None and booleans stay), and
    any string holding a URL."""
    if isinstance(value, dict):
        return {k: (REDACTED if _hidden(str(k), v, addresses) else redact(v, addresses))
                for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v, addresses) for v in value]
    if isinstance(value, str):
        if addresses and "://" in value:
            return REDACTED
        if "@" in value:
            return _USERINFO.sub("<redacted>@", value)
    return value


def _hidden(name: str, value: Any, addresses: bool) -> bool:
    if isinstance(value, (str, list, dict)) and value and secret_name(name):
        return True
    return (addresses and value is not None and not isinstance(value, bool)
            and address_name(name))
