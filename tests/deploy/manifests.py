"""Render the kustomize trees under deploy/k8s and find objects in the result."""

from __future__ import annotations

import functools
import shutil
import subprocess

import pytest
import yaml

from tests.procs import ROOT

K8S = ROOT / "deploy" / "k8s"
TREES = ("base", "sglang", "overlays/example")
# The Kubernetes version whose OpenAPI schemas the objects must satisfy (kubernetes-validate
# ships schemas for 1.25 to 1.37 offline); raise it when the cluster floor rises.
KUBERNETES_VERSION = "1.32"


@functools.cache
def _render(tree: str) -> tuple[dict, ...]:
    result = subprocess.run(["kubectl", "kustomize", str(K8S / tree)], capture_output=True,
                            text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, f"kubectl kustomize {tree}:\n{result.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def render(tree: str) -> tuple[dict, ...]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed (.ci/setup-k8s installs it)")
    return _render(tree)


def find(docs, kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def by_component(docs, component: str) -> dict:
    """The workload whose pods carry app.kubernetes.io/component=<component>."""
    found = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet") and
             d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component")
             == component]
    assert len(found) == 1, f"expected one {component} workload, found {len(found)}"
    return found[0]


def container(workload: dict, index: int = 0) -> dict:
    return workload["spec"]["template"]["spec"]["containers"][index]


def pod_labels(workload: dict) -> dict:
    return workload["spec"]["template"]["metadata"]["labels"]


def named_port(c: dict, name: str) -> int:
    return next(p["containerPort"] for p in c["ports"] if p["name"] == name)


def arg_value(args: list[str], flag: str) -> str:
    assert flag in args, f"{flag} missing from {args}"
    return args[args.index(flag) + 1]


def labels_match(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
