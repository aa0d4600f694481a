"""The registry agrees with the files; options are typed, validated, and name the bad key."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil

import pytest

import gateway.policies as package
from gateway.policies import REGISTRY, Policy, create_policy
from gateway.policies.base import build_options


def policies_by_module() -> dict[str, list[type[Policy]]]:
    found: dict[str, list[type[Policy]]] = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        found[info.name] = [
            cls for _, cls in inspect.getmembers(module, inspect.isclass)
            if issubclass(cls, Policy) and cls is not Policy and cls.__module__ == module.__name__
        ]
    return found


def test_every_policy_file_is_registered_under_its_stem() -> None:
    registered = set(REGISTRY.values())
    for stem, classes in policies_by_module().items():
        assert len(classes) <= 1, f"{stem}.py defines several policies"
        for cls in classes:
            assert cls.name == stem
            assert cls in registered, f"{stem}.py is not in REGISTRY"


def test_registry_keys_are_the_names() -> None:
    assert all(key == cls.name for key, cls in REGISTRY.items())
    assert {"cache_aware", "least_load", "power_of_two", "prefix_cache", "min_ttft"} <= set(REGISTRY)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_options_are_frozen_dataclasses_with_defaults(name: str) -> None:
    options_cls = REGISTRY[name].Options
    assert dataclasses.is_dataclass(options_cls)
    assert options_cls.__dataclass_params__.frozen
    defaults = build_options(REGISTRY[name], None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        defaults.x = 1  # type: ignore[misc]
    for role in ("prefill", "decode"):
        assert create_policy(name, role).role == role


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_unknown_option_is_rejected_by_name(name: str) -> None:
    with pytest.raises(ValueError, match="unknown option 'no_such_knob'"):
        create_policy(name, "prefill", {"no_such_knob": 1})


BAD_VALUES = [
    ("power_of_two", "token_unit", 0),
    ("least_load", "load_max_age", -1),
    ("least_load", "usage_weight", "high"),
    ("cache_aware", "match_threshold", 1.5),
    ("cache_aware", "balance_rel_threshold", 0.5),
    ("cache_aware", "balance_abs_threshold", -1),
    ("cache_aware", "max_tree_size", 0),
    ("cache_aware", "eviction_ttl", -5),
    ("cache_aware", "max_tree_size", True),
    ("prefix_cache", "endpoints", {"http://a:1": "a:5557"}),
    ("prefix_cache", "endpoints", "tcp://a:5557"),
    ("prefix_cache", "default_port", 70000),
    ("prefix_cache", "replay_port", -1),
    ("prefix_cache", "topic", 5),
    ("prefix_cache", "stale_after", 0),
    ("prefix_cache", "block_size", -16),
    ("prefix_cache", "max_blocks", 0),
    ("min_ttft", "prefill_tokens_per_second", 0),
    ("min_ttft", "token_unit", 0),
    ("min_ttft", "max_tree_size", -1),
]


@pytest.mark.parametrize(("name", "key", "value"), BAD_VALUES,
                         ids=[f"{n}-{k}-{v!r}" for n, k, v in BAD_VALUES])
def test_bad_values_are_rejected_naming_the_key(name: str, key: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"'{key}'"):
        create_policy(name, "prefill", {key: value})


@pytest.mark.parametrize(
    ("name", "raw", "field", "expected"),
    [
        pytest.param("cache_aware", {"match_threshold": 1}, "match_threshold", 1.0,
                     id="int_for_float_is_converted"),
        pytest.param("cache_aware", {"max_tree_size": 4096}, "max_tree_size", 4096,
                     id="int_kept"),
        pytest.param("prefix_cache", {"endpoints": {"http://a:1": "tcp://a:5557"}}, "endpoints",
                     {"http://a:1": "tcp://a:5557"}, id="mapping_option"),
    ],
)
def test_good_values_are_accepted(name, raw, field, expected) -> None:
    value = getattr(create_policy(name, "prefill", raw).options, field)
    assert value == expected and type(value) is type(expected)


def test_unknown_policy() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        create_policy("fastest", "prefill")
