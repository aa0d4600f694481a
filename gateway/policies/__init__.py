"""Policy registry: a new policy is one file in this package plus one line here."""

from __future__ import annotations

from gateway.policies.auto import AutoPolicy
from gateway.policies.base import Policy, build_options
from gateway.policies.cache_aware import CacheAwarePolicy
from gateway.policies.least_load import LeastLoadPolicy
from gateway.policies.min_ttft import MinTtftPolicy
from gateway.policies.power_of_two import PowerOfTwoPolicy
from gateway.policies.prefix_cache import PrefixCachePolicy
from gateway.policies.random import RandomPolicy
from gateway.policies.round_robin import RoundRobinPolicy
from gateway.policies.slo import SloPolicy

REGISTRY: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        RandomPolicy,
        RoundRobinPolicy,
        PowerOfTwoPolicy,
        LeastLoadPolicy,
        CacheAwarePolicy,
        PrefixCachePolicy,
        MinTtftPolicy,
        SloPolicy,
        AutoPolicy,
    )
}


def create_policy(name: str, role: str, raw_options: dict | None = None) -> Policy:
    """Instantiate a registered policy with validated options (ValueError names the problem)."""
    try:
        cls = REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(REGISTRY)}") from None
    return cls(role, build_options(cls, raw_options))


__all__ = ["REGISTRY", "Policy", "create_policy"]
