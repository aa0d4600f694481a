"""Where a pod finds its cluster's API: the service account files and two env variables.

`in_cluster_settings(environ)` turns them into config settings (`k8s_api_server`,
`k8s_token_file`, `k8s_ca_file`, `namespace`). It takes the environment as an argument so
that `gateway/config/settings.py` stays the one module that reads `os.environ`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from gateway.discovery.pods import host_in_url

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def in_cluster_settings(environ: Mapping[str, str],
                        account_dir: Path = SERVICE_ACCOUNT_DIR) -> dict[str, str]:
    """Settings for reaching the API from inside a pod; empty outside a cluster."""
    host = environ.get("KUBERNETES_SERVICE_HOST", "").strip()
    port = environ.get("KUBERNETES_SERVICE_PORT", "").strip()
    if not host or not port:
        return {}
    settings = {"k8s_api_server": f"https://{host_in_url(host)}:{port}"}
    for key, name in (("k8s_token_file", "token"), ("k8s_ca_file", "ca.crt")):
        if (account_dir / name).is_file():
            settings[key] = str(account_dir / name)
    try:
        namespace = (account_dir / "namespace").read_text().strip()
    except OSError:
        namespace = ""
    if namespace:
        settings["namespace"] = namespace
    return settings
