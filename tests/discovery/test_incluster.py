"""Finding the API server from inside a pod (environment passed in, not read)."""

from __future__ import annotations

from gateway.discovery.incluster import in_cluster_settings


def test_outside_a_cluster(tmp_path):
    assert in_cluster_settings({}, tmp_path) == {}


def test_inside_a_pod(tmp_path):
    (tmp_path / "token").write_text("tok\n")
    (tmp_path / "ca.crt").write_text("---")
    (tmp_path / "namespace").write_text("inference\n")
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    assert in_cluster_settings(env, tmp_path) == {
        "k8s_api_server": "https://10.96.0.1:443",
        "k8s_token_file": str(tmp_path / "token"),
        "k8s_ca_file": str(tmp_path / "ca.crt"),
        "namespace": "inference",
    }


def test_ipv6_service_host_without_account_files(tmp_path):
    env = {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "6443"}
    assert in_cluster_settings(env, tmp_path) == {"k8s_api_server": "https://[fd00::1]:6443"}
