"""deploy/k8s: renders with kustomize, validates against the Kubernetes schemas, and agrees
with the gateway (probes, CLI, ports, labels the discovery selects, RBAC, Prometheus)."""

from __future__ import annotations

import copy
import dataclasses
import json
import re

import pytest
import yaml

from gateway.config.settings import GatewayConfig, load_config, replica_id_from_pod_name
from tests.deploy.manifests import (
    KUBERNETES_VERSION,
    TREES,
    arg_value,
    by_component,
    container,
    find,
    labels_match,
    named_port,
    pod_labels,
    render,
)
from tests.discovery.fakekube import selector_matches
from tests.procs import ROOT

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed (.ci/setup-k8s)")

EXAMPLE = "overlays/example"
CONFIG_PATH = "/etc/pd-gateway/gateway.yaml"
WIRED = "prefill_selector" in {f.name for f in dataclasses.fields(GatewayConfig)}


def gateway_of(docs) -> dict:
    return find(docs, "StatefulSet", "pd-gateway")


def gateway_config_file(docs) -> dict:
    config_map = next(d for d in docs if d["kind"] == "ConfigMap"
                      and d["metadata"]["name"].startswith("pd-gateway-config"))
    return yaml.safe_load(config_map["data"]["gateway.yaml"])


def pre_stop_seconds(c: dict) -> int:
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep", command
    return int(command[1])


@pytest.mark.parametrize("tree", TREES)
def test_renders(tree):
    kinds = {d["kind"] for d in render(tree)}
    expected = {
        "base": {"ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Service", "StatefulSet",
                 "PodDisruptionBudget"},
        "sglang": {"Deployment", "PodDisruptionBudget"},
        EXAMPLE: {"Namespace", "ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Service",
                  "StatefulSet", "PodDisruptionBudget", "Deployment"},
    }[tree]
    assert kinds == expected


@pytest.mark.parametrize("tree", TREES)
def test_every_object_validates(tree):
    for doc in render(tree):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("mutate", [
    lambda sts: sts["spec"].__setitem__("replicas", "three"),
    lambda sts: sts["spec"]["template"]["spec"].__setitem__("terminationGracePeriod", 45),
    lambda sts: sts["spec"].pop("selector"),
], ids=["wrong-type", "unknown-field", "missing-required-field"])
def test_the_validator_is_strict(mutate):
    broken = copy.deepcopy(gateway_of(render("base")))
    mutate(broken)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_gateway_statefulset_probes_and_resources():
    sts = gateway_of(render(EXAMPLE))
    c = container(sts)
    assert sts["spec"]["replicas"] >= 2
    http = named_port(c, "http")
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readiness", "port": "http"}
    assert http == 8000
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(c["resources"][kind]), kind
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    pod = sts["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False


def test_statefulset_ordinals_are_distinct_replica_ids():
    sts = gateway_of(render(EXAMPLE))
    name, replicas = sts["metadata"]["name"], sts["spec"]["replicas"]
    ids = [replica_id_from_pod_name(f"{name}-{i}") for i in range(replicas)]
    assert ids == list(range(replicas))


def test_shutdown_fits_in_the_termination_grace():
    docs = render(EXAMPLE)
    sts = gateway_of(docs)
    grace = sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    shutdown = gateway_config_file(docs)["shutdown_grace"]
    assert pre_stop_seconds(container(sts)) + shutdown < grace


def test_config_file_keys_are_gateway_settings():
    fields = {f.name for f in dataclasses.fields(GatewayConfig)}
    discovery = {"prefill_selector", "decode_selector", "namespace", "k8s_worker_port",
                 "k8s_model_label", "k8s_drain_timeout"}
    keys = set(gateway_config_file(render("base")))
    assert keys <= fields | discovery, keys - fields - discovery
    if WIRED:
        assert keys <= fields


@pytest.mark.skipif(not WIRED, reason="discovery settings are not in gateway/config/settings.py yet "
                    "(the wiring patch adds --prefill-selector and friends)")
def test_container_args_parse_with_the_gateway_cli(tmp_path):
    docs = render(EXAMPLE)
    sts = gateway_of(docs)
    c = container(sts)
    config = secret_files_under(gateway_config_file(docs), tmp_path)
    config_file = tmp_path / "gateway.yaml"
    config_file.write_text(yaml.safe_dump(config))
    args = [str(config_file) if a == CONFIG_PATH else a for a in c["args"]]
    assert CONFIG_PATH in c["args"]
    mount = next(m for m in c["volumeMounts"] if m["name"] == "config")
    assert CONFIG_PATH.startswith(mount["mountPath"] + "/")
    environ = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    environ["POD_NAME"] = f"{sts['metadata']['name']}-2"
    environ.update(KUBERNETES_SERVICE_HOST="10.96.0.1", KUBERNETES_SERVICE_PORT="443")
    cfg = load_config(args, environ)
    assert (cfg.host, cfg.port) == ("0.0.0.0", named_port(c, "http"))
    assert cfg.replica_id == 2
    assert cfg.k8s_api_server == "https://10.96.0.1:443"
    assert cfg.prefill_selector and cfg.decode_selector
    assert cfg.api_keys == ("inference-key-from-the-secret",)
    assert cfg.admin_api_keys == ("admin-key-from-the-secret",)


KEY_FILES = {"api_key_file": "inference-key-from-the-secret",
             "admin_api_key_file": "admin-key-from-the-secret"}
KEY_SETTINGS = ("api_keys", "api_key", "admin_api_keys")
SECRET = "pd-gateway-keys"


def secret_files_under(config: dict, root) -> dict:
    """The config with its key files moved under `root`, holding one key each, as the
    Secret's volume gives them in the pod."""
    config = dict(config)
    for setting, key in KEY_FILES.items():
        path = root / config[setting].lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(key + "\n")
        config[setting] = str(path)
    return config


@pytest.mark.parametrize("tree", ["base", EXAMPLE])
def test_api_keys_come_from_a_secret_volume_never_from_args_env_or_the_config_map(tree):
    docs = render(tree)
    sts = gateway_of(docs)
    c = container(sts)
    flags = [a for a in c.get("args", []) + c.get("command", [])
             if a.lstrip("-").split("=")[0].replace("-", "_") in KEY_SETTINGS]
    assert not flags, f"keys on the command line show in ps: {flags}"
    for env in c.get("env", []):
        name = env["name"].removeprefix("GATEWAY_").lower()
        if name in KEY_SETTINGS:
            assert "value" not in env and "secretKeyRef" in env.get("valueFrom", {}), env
    config = gateway_config_file(docs)
    assert not set(KEY_SETTINGS) & set(config), "keys in the ConfigMap"
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    for setting in KEY_FILES:
        path = config[setting]
        mount = next(m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
        assert mount.get("readOnly") is True
        secret = volumes[mount["name"]]["secret"]
        assert secret["secretName"] == SECRET and secret.get("optional") is not True
        assert secret["defaultMode"] & 0o007 == 0, "the key files are readable by others"
        item = path[len(mount["mountPath"]) + 1:]
        assert item in {i["path"] for i in secret.get("items", [])} or not secret.get("items")
    assert not [d for d in docs if d["kind"] == "Secret"], "a Secret (with keys) in git"
    rendered = yaml.safe_dump_all(docs)
    assert "Bearer " not in rendered and "sk-" not in rendered


def test_selectors_pick_the_sglang_pods_of_their_role():
    docs = render(EXAMPLE)
    config = gateway_config_file(docs)
    prefill = pod_labels(by_component(docs, "prefill"))
    decode = pod_labels(by_component(docs, "decode"))
    gateway = pod_labels(gateway_of(docs))
    assert selector_matches(config["prefill_selector"], prefill)
    assert selector_matches(config["decode_selector"], decode)
    assert not selector_matches(config["prefill_selector"], decode)
    assert not selector_matches(config["decode_selector"], prefill)
    assert not any(selector_matches(config[k], gateway)
                   for k in ("prefill_selector", "decode_selector"))


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_sglang_workloads(role):
    docs = render(EXAMPLE)
    workload = by_component(docs, role)
    c = container(workload)
    argv = c["command"] + c["args"]
    assert argv[:3] == ["python3", "-m", "sglang.launch_server"]
    args = c["args"]
    assert arg_value(args, "--disaggregation-mode") == role
    assert arg_value(args, "--disaggregation-transfer-backend") == "mooncake"
    assert arg_value(args, "--disaggregation-ib-device") == "mlx5_0"
    assert arg_value(args, "--host") == "0.0.0.0"
    assert "--model-path" in args
    meta = workload["spec"]["template"]["metadata"]
    port = int(arg_value(args, "--port"))
    assert port == int(meta["annotations"]["sglang.ai/port"]) == named_port(c, "http")
    bootstrap = int(arg_value(args, "--disaggregation-bootstrap-port"))
    if role == "prefill":
        assert int(meta["annotations"]["sglang.ai/bootstrap-port"]) == bootstrap
        assert named_port(c, "bootstrap") == bootstrap
        # the gateways' prefix_cache policy subscribes to this publisher
        events = json.loads(arg_value(args, "--kv-events-config"))
        assert int(events["endpoint"].rsplit(":", 1)[1]) == named_port(c, "kv-events")
        assert gateway_config_file(docs)["prefill_policy"] == "prefix_cache"
    # the model label is what the gateway matches a request's "model" against
    model = meta["labels"][gateway_config_file(docs)["k8s_model_label"]]
    assert model == arg_value(args, "--served-model-name")
    limits = c["resources"]["limits"]
    assert int(limits["nvidia.com/gpu"]) >= 1 and "rdma/hca" in limits
    assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
    shm = next(m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm")
    assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory"
    for probe in ("startupProbe", "readinessProbe"):
        assert c[probe]["httpGet"]["port"] == "http"
    pdb = find(docs, "PodDisruptionBudget", f"sglang-{role}")
    assert labels_match(pdb["spec"]["selector"], meta["labels"])
    assert pre_stop_seconds(c) < workload["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"]


def test_rbac_lets_the_gateway_watch_pods():
    docs = render(EXAMPLE)
    sts = gateway_of(docs)
    account = sts["spec"]["template"]["spec"]["serviceAccountName"]
    binding = find(docs, "RoleBinding")
    role = find(docs, "Role", binding["roleRef"]["name"])
    assert {"kind": "ServiceAccount", "name": account, "namespace": "inference"} in \
        binding["subjects"]
    rule = next(r for r in role["rules"] if "pods" in r["resources"])
    assert rule["apiGroups"] == [""] and {"get", "list", "watch"} <= set(rule["verbs"])
    assert all(d["metadata"].get("namespace") == "inference"
               for d in docs if d["kind"] not in ("Namespace",))


def test_services_and_pdb_select_the_gateway():
    docs = render(EXAMPLE)
    sts = gateway_of(docs)
    labels = pod_labels(sts)
    assert sts["spec"]["serviceName"] in {d["metadata"]["name"] for d in docs
                                          if d["kind"] == "Service"}
    for service in (d for d in docs if d["kind"] == "Service"):
        assert all(labels.get(k) == v for k, v in service["spec"]["selector"].items())
        assert service["spec"]["ports"][0]["targetPort"] == "http"
    pdb = find(docs, "PodDisruptionBudget", "pd-gateway")
    assert labels_match(pdb["spec"]["selector"], labels)
    assert pdb["spec"]["maxUnavailable"] < sts["spec"]["replicas"]


def kubernetes_scrape_job() -> dict:
    """The commented kubernetes_sd job of deploy/prometheus/prometheus.yml."""
    text = (ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text()
    block = text.split("# k8s-begin", 1)[1].split("# k8s-end", 1)[0]
    lines = [re.sub(r"^\s*# ?", "", line) for line in block.splitlines() if line.strip()]
    return yaml.safe_load("\n".join(lines))[0]


def test_prometheus_scrapes_the_gateway_pods():
    sts = gateway_of(render(EXAMPLE))
    meta = sts["spec"]["template"]["metadata"]
    annotations = meta["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == named_port(container(sts), "http")
    assert annotations["prometheus.io/path"] == "/metrics"
    keep = [r for r in kubernetes_scrape_job()["relabel_configs"] if r.get("action") == "keep"]
    label_rule = next(r for r in keep if "__meta_kubernetes_pod_label_app_kubernetes_io_name"
                      in r["source_labels"])
    assert re.fullmatch(label_rule["regex"], meta["labels"]["app.kubernetes.io/name"])


def test_overlay_pins_images():
    docs = render(EXAMPLE)
    gateway_image = container(gateway_of(docs))["image"]
    assert ":" in gateway_image and gateway_image != "pd-gateway"
