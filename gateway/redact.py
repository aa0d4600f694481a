"""Secrets out of what the servers say before the gateway repeats it to callers.

`/server_info`, `/v1/models` and the model names the gateway lists come from the servers'
own arguments, which may hold API keys, tokens or a private hub's password in a model path.
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


def secret_name(name: str) -> bool:
    words = _WORD.split(_CAMEL.sub("_", name).lower())
    return any(word in SECRET_WORDS for word in words)


def redact(value: Any) -> Any:
    """A copy of a JSON value with secret fields replaced (recursively): fields whose name
    holds a secret word and whose value could hold one (a non-empty string, list or object;
    None, booleans and numbers stay: they say "not set" or "on"), and passwords in URLs."""
    if isinstance(value, dict):
        return {k: (REDACTED if secret_name(str(k)) and isinstance(v, (str, list, dict)) and v
                    else redact(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    if isinstance(value, str) and "@" in value:
        return _USERINFO.sub("<redacted>@", value)
    return value
