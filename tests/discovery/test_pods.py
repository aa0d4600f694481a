"""What a pod means: serving or not, URL, port, bootstrap port and model (no I/O)."""

from __future__ import annotations

import pytest

from gateway.discovery.pods import PodRules, is_serving, target_of
from tests.discovery.fakekube import make_pod


def terminating(pod: dict) -> dict:
    pod["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    return pod


@pytest.mark.parametrize("pod, serving", [
    (make_pod("p"), True),
    (make_pod("p", ready=False), False),
    (make_pod("p", phase="Pending"), False),
    (make_pod("p", phase="Succeeded"), False),
    (make_pod("p", ip=None), False),
    (terminating(make_pod("p")), False),
    ({"metadata": {"name": "p"}, "status": {"phase": "Running", "podIP": "10.0.0.1"}}, False),
], ids=["running-ready", "not-ready", "pending", "succeeded", "no-ip", "terminating",
        "no-conditions"])
def test_serving(pod, serving):
    assert is_serving(pod) is serving
    assert (target_of(pod, "decode") is not None) is serving


@pytest.mark.parametrize("pod, role, url, bootstrap", [
    (make_pod("p", ip="10.1.2.3"), "decode", "http://10.1.2.3:30000", None),
    (make_pod("p", ip="10.1.2.3", annotations={"sglang.ai/bootstrap-port": "9001"}),
     "prefill", "http://10.1.2.3:30000", 9001),
    (make_pod("p", annotations={"sglang.ai/bootstrap-port": "9001"}),
     "decode", "http://10.0.0.1:30000", None),
    (make_pod("p", annotations={"sglang.ai/bootstrap-port": "not-a-port"}),
     "prefill", "http://10.0.0.1:30000", None),
    (make_pod("p", annotations={"sglang.ai/port": "31000"},
              ports=[{"name": "http", "containerPort": 32000}]),
     "decode", "http://10.0.0.1:31000", None),
    (make_pod("p", ports=[{"name": "metrics", "containerPort": 9000},
                          {"name": "http", "containerPort": 32000}]),
     "decode", "http://10.0.0.1:32000", None),
    (make_pod("p", annotations={"sglang.ai/port": "99999"}),
     "decode", "http://10.0.0.1:30000", None),
    (make_pod("p", ip="fd00::7"), "decode", "http://[fd00::7]:30000", None),
], ids=["default-port", "bootstrap-annotation", "bootstrap-ignored-on-decode",
        "bad-bootstrap-annotation", "port-annotation-wins", "named-http-port",
        "out-of-range-port-annotation", "ipv6"])
def test_address(pod, role, url, bootstrap):
    target = target_of(pod, role)
    assert (target.url, target.role, target.bootstrap_port) == (url, role, bootstrap)


@pytest.mark.parametrize("pod, rules, model", [
    (make_pod("p", labels={"sglang.ai/model": "llama-3-8b"}), PodRules(), "llama-3-8b"),
    (make_pod("p", annotations={"sglang.ai/model": "meta-llama/Llama-3-8B"}), PodRules(),
     "meta-llama/Llama-3-8B"),
    (make_pod("p", labels={"model": "qwen"}), PodRules(model_key="model"), "qwen"),
    (make_pod("p"), PodRules(), None),
], ids=["label", "annotation-for-slashes", "configured-key", "none"])
def test_model(pod, rules, model):
    assert target_of(pod, "decode", rules).model == model


def test_default_port_is_configurable():
    assert target_of(make_pod("p"), "decode", PodRules(default_port=8080)).url.endswith(":8080")


def test_identity_changes_with_the_pod_not_the_model():
    a = target_of(make_pod("a", labels={"sglang.ai/model": "m1"}), "decode")
    same = target_of(make_pod("a", labels={"sglang.ai/model": "m2"}), "decode")
    other = target_of(make_pod("b"), "decode")
    assert a.identity == same.identity
    assert a.url == other.url and a.identity != other.identity
