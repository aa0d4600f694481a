"""The shipped Prometheus config, rules and Grafana dashboard: valid, and about real metrics."""

from __future__ import annotations

import re
import subprocess

import pytest
import yaml
from prometheus_client import CollectorRegistry

from gateway.observability.metrics import Metrics
from gateway.servers.pool import ServerPool
from tests.observability.conftest import require_binaries
from tests.observability.dashboards import (
    PROMETHEUS_CONFIG,
    RULES,
    kubernetes_scrape_config,
    load_dashboard,
    load_rules,
    panels,
    targets,
)
from tests.procs import ROOT

METRIC = re.compile(r"\bgateway_[a-z_]+")
SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_created")
# What the dashboard must show (the metrics named in its brief).
REQUIRED_ON_DASHBOARD = {
    "gateway_requests", "gateway_time_to_first_token_seconds",
    "gateway_inter_token_latency_seconds", "gateway_request_duration_seconds",
    "gateway_server_in_flight_requests", "gateway_usable_servers", "gateway_server_healthy",
    "gateway_server_breaker_state", "gateway_retries", "gateway_admission_rejections",
    "gateway_queue_time_seconds", "gateway_routing_decisions", "gateway_cached_tokens",
    "gateway_prompt_tokens", "gateway_streamed_bytes", "gateway_tenant_tokens",
    "gateway_tenant_requests", "gateway_tenant_errors",
}
REQUIRED_ALERTS = {"GatewayDown", "GatewayHighErrorRate", "NoHealthyPrefill", "NoHealthyDecode",
                   "GatewayTTFTP99High", "GatewayServerBreakerOpen"}


def promtool(*args: str) -> subprocess.CompletedProcess:
    binary = require_binaries("promtool")["promtool"]
    result = subprocess.run([binary, *args], capture_output=True, text=True, timeout=60,
                            cwd=ROOT)
    assert result.returncode == 0, f"promtool {' '.join(args)}:\n{result.stdout}{result.stderr}"
    return result


def gateway_metric_families() -> set[str]:
    registry = CollectorRegistry()
    Metrics(registry, ServerPool())
    return {family.name for family in registry.collect()}


def family_of(name: str) -> str:
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def metrics_named_in(text: str) -> set[str]:
    """gateway_* metric families a query text names (recording rule names excluded)."""
    return {family_of(m) for m in METRIC.findall(text)}


def relabel(configs: list[dict], labels: dict[str, str]) -> dict[str, str] | None:
    """The keep, drop and replace actions of Prometheus relabelling; None: target dropped."""
    labels = dict(labels)
    for config in configs:
        value = config.get("separator", ";").join(
            labels.get(name, "") for name in config.get("source_labels", []))
        regex = re.compile(f"^(?:{config.get('regex', '(.*)')})$")
        match = regex.match(value)
        action = config.get("action", "replace")
        if action == "keep" and not match:
            return None
        if action == "drop" and match:
            return None
        if action == "replace" and match:
            replacement = re.sub(r"\$(\d)", r"\\\1", str(config.get("replacement", "$1")))
            labels[config["target_label"]] = match.expand(replacement)
    return labels


@pytest.mark.prometheus
def test_promtool_accepts_the_rules():
    out = promtool("check", "rules", str(RULES)).stdout
    assert f"{len(load_rules())} rules found" in out


@pytest.mark.prometheus
def test_promtool_accepts_the_config():
    promtool("check", "config", str(PROMETHEUS_CONFIG))


def test_documented_kubernetes_job_follows_the_pod_annotations():
    """Apply the job's relabelling (as Prometheus would, RE2 anchored) to two pods."""
    (job,) = kubernetes_scrape_config()
    assert job["job_name"] == "pd-gateway"
    assert job["kubernetes_sd_configs"] == [{"role": "pod"}]
    gateway_pod = {
        "__address__": "10.1.2.3:9999",
        "__metrics_path__": "/metrics",
        "__meta_kubernetes_pod_annotation_prometheus_io_scrape": "true",
        "__meta_kubernetes_pod_annotation_prometheus_io_port": "8000",
        "__meta_kubernetes_pod_annotation_prometheus_io_path": "/metrics",
        "__meta_kubernetes_pod_label_app_kubernetes_io_name": "pd-gateway",
        "__meta_kubernetes_pod_phase": "Running",
        "__meta_kubernetes_pod_ip": "10.1.2.3",
        "__meta_kubernetes_namespace": "serving",
        "__meta_kubernetes_pod_name": "pd-gateway-0",
    }
    kept = relabel(job["relabel_configs"], gateway_pod)
    assert kept is not None
    assert kept["__address__"] == "10.1.2.3:8000"
    assert (kept["namespace"], kept["pod"]) == ("serving", "pd-gateway-0")
    unannotated = {**gateway_pod, "__meta_kubernetes_pod_annotation_prometheus_io_scrape": ""}
    assert relabel(job["relabel_configs"], unannotated) is None


@pytest.mark.prometheus
def test_promtool_accepts_the_documented_kubernetes_job(tmp_path):
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["scrape_configs"] = kubernetes_scrape_config()
    config["rule_files"] = [str(RULES)]
    path = tmp_path / "prometheus-kubernetes.yml"
    path.write_text(yaml.safe_dump(config))
    binary = require_binaries("promtool")["promtool"]
    result = subprocess.run([binary, "check", "config", str(path)], capture_output=True,
                            text=True, timeout=60)
    if "kubernetes_sd_configs not found" in result.stderr + result.stdout:
        pytest.skip("this promtool is built without Kubernetes service discovery (Debian's "
                    "package); the relabelling is checked by the test above")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.prometheus
def test_alert_rules_fire_as_specified():
    """promtool unit tests: synthetic series in, expected alerts and recorded values out."""
    promtool("test", "rules", str(ROOT / "tests" / "observability" / "rules_test.yml"))


def test_rules_name_real_metrics_and_the_required_alerts():
    rules = load_rules()
    known = gateway_metric_families()
    for rule in rules:
        unknown = metrics_named_in(rule["expr"]) - known
        assert not unknown, f"{rule.get('record') or rule.get('alert')} uses unknown {unknown}"
    alerts = {rule["alert"] for rule in rules if "alert" in rule}
    assert REQUIRED_ALERTS <= alerts
    for rule in rules:
        if "alert" in rule:
            assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
            assert rule["annotations"]["summary"], rule["alert"]


def test_dashboard_is_importable_grafana_json():
    dashboard = load_dashboard()
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert dashboard["uid"] and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    rows = [p for p in dashboard["panels"] if p["type"] == "row"]
    ids = [p["id"] for p in rows + panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels(dashboard):
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], f"{panel['title']} has no query"
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            assert target["expr"].strip() and target["refId"], panel["title"]


def test_dashboard_covers_the_gateway_metrics():
    dashboard = load_dashboard()
    known = gateway_metric_families()
    named: set[str] = set()
    for target in targets(dashboard):
        found = metrics_named_in(target.expr)
        assert found, f"{target.name} names no gateway metric"
        assert found <= known, f"{target.name} uses unknown {found - known}"
        named |= found
    assert REQUIRED_ON_DASHBOARD <= named, f"missing {REQUIRED_ON_DASHBOARD - named}"
