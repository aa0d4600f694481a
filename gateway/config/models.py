"""The model settings of the config: aliases, the default model, per-model policies.

Checked when the config is loaded, so a bad alias or a bad policy option of one model exits 2
before the port is bound, like every other setting; read by `gateway/scheduling/models.py` when it
creates a model's policies. No I/O.

A model's policies are its own entry of `model_policies` where it has one, else the global
settings (`--prefill-policy`, `--decode-policy`, `--policy`, then cache_aware and
least_load).
Its `policy_options` for a policy are merged key by key over the global `policy_options` of
that policy, so a model states only what differs; a policy built on others (auto) reads their
options first (`Policy.inherited_options`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.config.servers import ConfigError
from gateway.policies import REGISTRY, Policy, create_policy

if TYPE_CHECKING:
    from gateway.config.schema import GatewayConfig

# `auto`: a request without latency objectives is placed exactly as by cache_aware (prefill)
# and least_load (decode); one with objectives keeps the cache-aware prefill, and the SLO
# model chooses its decode and the gate refuses early what no pair can serve in time.
# Measured against cache_aware + least_load on the Qwen2.5-32B H200 calibration
# (docs/SCHEDULING.md, "The default policy, and `auto`")
DEFAULT_POLICIES = {"prefill": "auto", "decode": "auto"}
# SGLang's DEFAULT_MODEL_NAME (entrypoints/openai/protocol.py): what its OpenAI API assumes
# when a request names no model, so it means "the default model" here too
DEFAULT_NAME = "default"
MODEL_POLICY_KEYS = ("policy", "prefill_policy", "decode_policy", "policy_options")


def policy_choice(cfg: GatewayConfig, model: str | None, role: str) -> tuple[str, dict | None]:
    """The policy name and raw options of `role` for `model` (None: the global choice)."""
    own = ((cfg.model_policies or {}).get(model) if model is not None else None) or {}
    name = (own.get(f"{role}_policy") or own.get("policy") or getattr(cfg, f"{role}_policy")
            or cfg.policy or DEFAULT_POLICIES[role])
    sources = (*REGISTRY[name].inherited_options(role), name) if name in REGISTRY else (name,)
    options: dict = {}
    for table in (cfg.policy_options or {}, own.get("policy_options") or {}):
        for source in sources:  # the global options, then the model's own: it wins
            options.update(table.get(source) or {})
    return name, options or None


def build_policies(cfg: GatewayConfig, model: str | None,
                   prefixes: object = None) -> dict[str, Policy]:
    """New policy instances of both roles for `model`: its own state, shared with no other
    policy of this process; with `--workers`, `prefixes` is the table where every worker
    process records where it sent prompts (policies/shared_prefixes.py)."""
    policies = {}
    for role in DEFAULT_POLICIES:
        name, options = policy_choice(cfg, model, role)
        policies[role] = create_policy(name, role, options)
        if prefixes is not None:
            policies[role].share(prefixes)
    return policies


def wants_token_ids(cfg: GatewayConfig) -> bool:
    """Whether some model's prefill policy matches token ids (then every prompt is
    tokenized where the tokenizer serves its model)."""
    models = [None, *(cfg.model_policies or {})]
    return any(REGISTRY[policy_choice(cfg, m, "prefill")[0]].wants_token_ids for m in models)


def configured_names(cfg: GatewayConfig) -> frozenset[str]:
    """Every model name the settings mention: these are known even before a server of theirs
    registers (a request for one then gets a 503, not a 404)."""
    names = set((cfg.model_aliases or {}).values()) | set(cfg.model_policies or {})
    if cfg.default_model:
        names.add((cfg.model_aliases or {}).get(cfg.default_model, cfg.default_model))
    return frozenset(names)


def check_model_settings(cfg: GatewayConfig) -> None:
    """Rules of the model settings; ConfigError names the setting and the entry."""
    aliases = cfg.model_aliases or {}
    if not isinstance(aliases, dict):
        raise ConfigError("setting 'model_aliases': expected an object {alias: model name}")
    for alias, target in aliases.items():
        if not isinstance(target, str) or not target or not alias:
            raise ConfigError(f"setting 'model_aliases': {alias!r} must name a model")
        if alias == DEFAULT_NAME:
            raise ConfigError("setting 'model_aliases': 'default' already means the default "
                              "model; set --default-model instead")
        if target in aliases:
            raise ConfigError(f"setting 'model_aliases': {alias!r} names the alias {target!r}; "
                              "an alias must name a model")
    if cfg.default_model == DEFAULT_NAME:
        raise ConfigError("setting 'default_model': name a model, not 'default'")
    policies = cfg.model_policies or {}
    if not isinstance(policies, dict):
        raise ConfigError("setting 'model_policies': expected an object {model: settings}")
    for model, own in policies.items():
        where = f"setting 'model_policies', model {model!r}"
        if model in aliases:
            raise ConfigError(f"{where}: is an alias; name the model {aliases[model]!r}")
        if not isinstance(own, dict):
            raise ConfigError(f"{where}: expected an object of {', '.join(MODEL_POLICY_KEYS)}")
        for key, value in own.items():
            if key not in MODEL_POLICY_KEYS:
                raise ConfigError(f"{where}: unknown key {key!r} (known: "
                                  f"{', '.join(MODEL_POLICY_KEYS)})")
            if key != "policy_options" and value is not None and value not in REGISTRY:
                raise ConfigError(f"{where}: {key} {value!r} is unknown; must be one of "
                                  f"{sorted(REGISTRY)}")
        options = own.get("policy_options") or {}
        if not isinstance(options, dict) or any(k not in REGISTRY or not isinstance(v, dict)
                                                for k, v in options.items()):
            raise ConfigError(f"{where}: policy_options must map policy names to objects")
        try:
            build_policies(cfg, model)
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
