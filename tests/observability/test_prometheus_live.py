"""A real Prometheus scrapes a real gateway under traffic; every dashboard query and every
recording rule must then return data, and every rule must load healthy."""

from __future__ import annotations

import math
import time

import httpx
import pytest
import yaml

from tests.observability.conftest import require_binaries
from tests.observability.dashboards import (
    RULES,
    load_dashboard,
    load_rules,
    panels,
    substitute,
    targets,
)
from tests.observability.traffic import mixed_traffic
from tests.procs import HOST, free_port, running

pytestmark = pytest.mark.prometheus

JOB = "pd-gateway"
DEADLINE = 30.0  # seconds for all queries together to return data


class PromAPI:
    def __init__(self, url: str) -> None:
        self.url = url

    def get(self, path: str, **params) -> dict:
        r = httpx.get(self.url + path, params=params, timeout=10)
        r.raise_for_status()
        body = r.json()
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        data = self.get("/api/v1/query", query=expr)
        assert data["resultType"] == "vector", f"{expr}: {data['resultType']}"
        return data["result"]


def finite(result: list[dict]) -> bool:
    """At least one series with a real number (not NaN from an empty histogram or 0/0)."""
    return any(math.isfinite(float(series["value"][1])) for series in result)


def wait_for(check, timeout: float = DEADLINE, interval: float = 0.5):
    """Call `check` until it returns something true or the time is up; its last result."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(interval)


@pytest.fixture(scope="module")
def prometheus(request, tmp_path_factory):
    binary = require_binaries("prometheus")["prometheus"]
    observed = request.getfixturevalue("observed")  # only once Prometheus is known to exist
    home = tmp_path_factory.mktemp("prometheus")
    gateway = observed.gateway.removeprefix("http://")
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                   "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{"job_name": JOB, "static_configs": [{"targets": [gateway]}]}],
    }
    (home / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    url = f"http://{HOST}:{port}"
    argv = [binary, f"--config.file={home / 'prometheus.yml'}",
            f"--storage.tsdb.path={home / 'data'}", f"--web.listen-address={HOST}:{port}",
            "--log.level=warn"]
    with running("prometheus", argv, home, url + "/-/ready", timeout=30) as proc:
        api = PromAPI(url)
        up = wait_for(lambda: api.query(f'up{{job="{JOB}"}} == 1'))
        assert up, f"Prometheus never scraped the gateway:\n{proc.log()}"
        yield api


@pytest.fixture(scope="module")
def scraped_traffic(prometheus, observed):
    """Two rounds of traffic a few scrapes apart, so every series has moved between scrapes."""
    first = mixed_traffic(observed)
    time.sleep(2.5)
    second = mixed_traffic(observed)
    statuses = first + second
    assert statuses[200] > 0 and statuses[429] > 0 and statuses[400] > 0, statuses
    assert any(status >= 500 for status in statuses), statuses
    return statuses


def test_every_dashboard_query_returns_data(prometheus, scraped_traffic):
    pending = {t.name: t.expr for t in targets(load_dashboard())}
    assert len(pending) >= 20

    def all_answered() -> bool:
        for name, expr in list(pending.items()):
            if finite(prometheus.query(expr)):
                del pending[name]
        return not pending

    wait_for(all_answered)
    assert not pending, "dashboard queries without data:\n" + "\n".join(
        f"  {name}: {expr}" for name, expr in pending.items())


def test_template_variables_list_the_gateway(prometheus, scraped_traffic, observed):
    """The job and instance pickers (label_values over gateway_usable_servers)."""
    match = {"match[]": "gateway_usable_servers"}
    assert JOB in prometheus.get("/api/v1/label/job/values", **match)
    instances = prometheus.get("/api/v1/label/instance/values", **match)
    assert observed.gateway.removeprefix("http://") in instances


def test_tenant_token_panel_splits_cached_uncached_and_completion(prometheus, scraped_traffic):
    """The per-tenant usage panel, as Grafana would query it, and the tenant picker."""
    (panel,) = [p for p in panels(load_dashboard()) if p["title"] == "Token usage per tenant"]
    (expr,) = [substitute(t["expr"]) for t in panel["targets"]]

    def kinds() -> dict[tuple[str, str], float]:
        return {(s["metric"]["tenant"], s["metric"]["kind"]): float(s["value"][1])
                for s in prometheus.query(expr)}

    seen = wait_for(lambda: (k := kinds()) and {kind for _, kind in k} == {
        "cached", "uncached", "completion"} and k)
    assert seen, f"no per-tenant split: {kinds()}"
    assert all(tenant == "anonymous" for tenant, _ in seen)  # the traffic sends no key
    assert all(value > 0 for value in seen.values()), seen
    assert "anonymous" in prometheus.get("/api/v1/label/tenant/values",
                                         **{"match[]": "gateway_tenant_requests_total"})


def test_every_recording_rule_evaluates_to_data(prometheus, scraped_traffic):
    pending = {r["record"] for r in load_rules() if "record" in r}

    def all_recorded() -> bool:
        for name in list(pending):
            if finite(prometheus.query(name)):
                pending.discard(name)
        return not pending

    wait_for(all_recorded)
    assert not pending, f"recording rules without data: {sorted(pending)}"


def test_every_rule_loads_healthy(prometheus, scraped_traffic):
    expected = {(r["group"], r.get("record") or r["alert"]) for r in load_rules()}

    def loaded() -> dict:
        groups = prometheus.get("/api/v1/rules")["groups"]
        health = {(g["name"], r["name"]): (r["health"], r.get("lastError", ""))
                  for g in groups for r in g["rules"]}
        ready = set(health) == expected and all(h == "ok" for h, _ in health.values())
        return health if ready else {}

    health = wait_for(loaded)
    assert health, f"rules not all loaded and healthy: {prometheus.get('/api/v1/rules')}"


def test_no_alert_fires_on_a_healthy_cluster(prometheus, scraped_traffic):
    """The few errors of the traffic must not page anyone (every alert waits a while)."""
    firing = [a for a in prometheus.get("/api/v1/alerts")["alerts"] if a["state"] == "firing"]
    assert firing == []
