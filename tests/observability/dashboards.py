"""Read the shipped Grafana dashboard and Prometheus rules: their queries, made runnable."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import yaml

from tests.procs import ROOT

GRAFANA_DASHBOARD = ROOT / "deploy" / "grafana" / "gateway-dashboard.json"
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
RULES = ROOT / "deploy" / "prometheus" / "rules.yml"

# What Grafana would put in place of its variables when the test queries Prometheus directly:
# "All" for the job and instance pickers, a window that holds the whole test run for rates.
SUBSTITUTIONS = {
    "__rate_interval": "1m",
    "__interval": "15s",
    "__range": "5m",
    "job": ".*",
    "instance": ".*",
    "tenant": ".*",
    "datasource": "prometheus",
}
VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")


@dataclass(frozen=True)
class Target:
    panel: str
    ref_id: str
    expr: str

    @property
    def name(self) -> str:
        return f"{self.panel} [{self.ref_id}]"


def load_dashboard() -> dict:
    return json.loads(GRAFANA_DASHBOARD.read_text())


def panels(dashboard: dict) -> list[dict]:
    """Every panel, rows' nested panels included, rows themselves excluded."""
    out = []
    for panel in dashboard["panels"]:
        if panel.get("type") == "row":
            out.extend(panel.get("panels", []))
        else:
            out.append(panel)
    return out


def substitute(expr: str) -> str:
    def replace(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if name not in SUBSTITUTIONS:
            raise KeyError(f"no test value for dashboard variable ${name} in {expr!r}")
        return SUBSTITUTIONS[name]

    return VARIABLE.sub(replace, expr)


def targets(dashboard: dict) -> list[Target]:
    return [Target(p["title"], t["refId"], substitute(t["expr"]))
            for p in panels(dashboard) for t in p.get("targets", [])]


def load_rules() -> list[dict]:
    """Every rule of rules.yml, each with its group name under "group"."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [{**rule, "group": group["name"]} for group in groups for rule in group["rules"]]


def kubernetes_scrape_config() -> list[dict]:
    """The commented-out Kubernetes job of prometheus.yml (between k8s-begin and k8s-end)."""
    text = PROMETHEUS_CONFIG.read_text()
    block = text.split("# k8s-begin\n", 1)[1].split("# k8s-end", 1)[0]
    lines = [re.sub(r"^\s*# ?", "", line) for line in block.splitlines()]
    return yaml.safe_load("\n".join(lines))
