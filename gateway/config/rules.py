"""The rules of the config that span settings (single values are checked by their types).

Apart from `settings.py` so that the settings' declarations stay one readable table; run by
`load_config` once the `GatewayConfig` is built, before the port is bound: a broken rule is a
ConfigError naming the settings (exit 2).
"""

from __future__ import annotations

import ipaddress
import os
from typing import TYPE_CHECKING

from gateway.config.models import check_model_settings
from gateway.config.servers import ConfigError
from gateway.config.tenants import check_tenancy
from gateway.policies import REGISTRY
from gateway.upstream.choices import MissingClient, upstream_class

if TYPE_CHECKING:
    from gateway.config.schema import GatewayConfig


def validate(cfg: GatewayConfig) -> None:
    """Raise ConfigError for the first rule `cfg` breaks."""
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
            raise ConfigError(f"setting {name!r}: {value!r} is unknown; "
                              f"must be one of {sorted(REGISTRY)}")
    for key in cfg.policy_options or {}:
        if key not in REGISTRY:
            raise ConfigError(f"setting 'policy_options': no policy named {key!r}")
    check_model_settings(cfg)
    try:
        upstream_class(cfg.upstream_client)  # its library is installed
    except MissingClient as exc:
        raise ConfigError(f"setting 'upstream_client': {exc}") from None
    if cfg.retry_backoff_max < cfg.retry_backoff:
        raise ConfigError("setting 'retry_backoff_max' must be >= 'retry_backoff'")
    if bool(cfg.ssl_certfile) != bool(cfg.ssl_keyfile):
        raise ConfigError("settings 'ssl_certfile' and 'ssl_keyfile' go together")
    if cfg.ssl_ca_certs and not cfg.ssl_certfile:
        raise ConfigError("setting 'ssl_ca_certs' (client certificates) needs 'ssl_certfile'")
    for name in ("ssl_certfile", "ssl_keyfile", "ssl_ca_certs"):
        path = getattr(cfg, name)
        if path and not os.path.isfile(path):
            raise ConfigError(f"setting {name!r}: no file {path!r}")
    if cfg.tokenizer and not (os.path.isfile(cfg.tokenizer) or os.path.isfile(
            os.path.join(cfg.tokenizer, "tokenizer.json"))):
        raise ConfigError(f"setting 'tokenizer': {cfg.tokenizer!r} is neither a tokenizer.json "
                          "file nor a directory holding one")
    urls = [s.url for s in cfg.prefill + cfg.decode]
    dupes = {u for u in urls if urls.count(u) > 1}
    if dupes:
        raise ConfigError(f"server listed twice: {', '.join(sorted(dupes))}")
    for key in cfg.api_keys + cfg.admin_api_keys:
        if not key or any(c.isspace() or not c.isprintable() for c in key):
            raise ConfigError("API keys must be printable and without spaces")
    if set(cfg.api_keys) & set(cfg.admin_api_keys):
        raise ConfigError("a key may not be both an inference and an admin key")
    check_tenancy(cfg)
    try:
        ipaddress.ip_address(cfg.host.strip("[]"))
    except ValueError:
        if not cfg.host or " " in cfg.host:
            raise ConfigError(f"setting 'host': bad listen address {cfg.host!r}") from None
