"""deploy/k8s/autoscaling: HPAs that scale the SGLang Deployments of deploy/k8s/sglang on the
gateway's `gateway_desired_servers{role}` (docs/ROLE_SWITCH.md)."""

from __future__ import annotations

import pytest

from gateway.observability.metrics import RebalanceCollector
from tests.deploy.manifests import KUBERNETES_VERSION, find, render

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed (.ci/setup-k8s)")

TREE = "autoscaling"


def test_every_object_validates():
    docs = render(TREE)
    assert {d["kind"] for d in docs} == {"HorizontalPodAutoscaler"}
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_each_role_scales_its_deployment_on_the_metric_the_gateway_publishes(role):
    hpa = find(render(TREE), "HorizontalPodAutoscaler", f"sglang-{role}")
    target = hpa["spec"]["scaleTargetRef"]
    find(render("sglang"), target["kind"], target["name"])  # the Deployment exists
    (metric,) = hpa["spec"]["metrics"]
    external = metric["external"]
    assert external["metric"]["selector"]["matchLabels"] == {"role": role}
    # averageValue 1: the HPA asks for exactly the metric's value
    assert external["target"] == {"type": "AverageValue", "averageValue": "1"}
    figures = {"desired": {("m", role): 3}, "pressure": {}}
    families = {f.name: f for f in RebalanceCollector(lambda: figures).collect()}
    assert external["metric"]["name"] in families
    (sample,) = families[external["metric"]["name"]].samples
    assert sample.labels["role"] == role and sample.value == 3
    assert hpa["spec"]["minReplicas"] >= 1
