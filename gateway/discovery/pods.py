"""What a Kubernetes pod means to the gateway: a server to use, or nothing yet.

Pure functions over the pod JSON the API returns; no I/O. A pod is a server only while it
is Running, Ready (condition Ready=True), has a pod IP and is not being deleted. Its URL is
`http://<podIP>:<port>`, the port taken, in this order, from the annotation `sglang.ai/port`,
a container port named `http`, or a default (30000, SGLang's own). A prefill's bootstrap
port comes from the annotation `sglang.ai/bootstrap-port` (as sglang-router reads it); when
absent the gateway learns it from the server's /server_info. The model comes from a label
(or, since label values cannot hold a `/`, an annotation) with a configurable key.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

PORT_ANNOTATION = "sglang.ai/port"
BOOTSTRAP_PORT_ANNOTATION = "sglang.ai/bootstrap-port"
MODEL_KEY = "sglang.ai/model"
PORT_NAME = "http"
DEFAULT_PORT = 30000


@dataclass(frozen=True)
class PodRules:
    """Where the gateway reads a server's port, bootstrap port and model on its pod."""

    default_port: int = DEFAULT_PORT
    port_annotation: str = PORT_ANNOTATION
    port_name: str = PORT_NAME
    bootstrap_annotation: str = BOOTSTRAP_PORT_ANNOTATION
    model_key: str = MODEL_KEY


DEFAULT_RULES = PodRules()


@dataclass(frozen=True)
class Target:
    """A ready pod as the gateway will register it."""

    url: str
    role: str
    bootstrap_port: int | None
    model: str | None
    pod: str  # pod name, for logs
    uid: str  # a new pod at a reused IP is a new server

    @property
    def identity(self) -> tuple:
        """What cannot change without replacing the server (the model can be updated)."""
        return (self.role, self.bootstrap_port, self.uid)


def pod_name(pod: dict) -> str:
    return str((pod.get("metadata") or {}).get("name", ""))


def resource_version(obj: dict) -> str | None:
    value = (obj.get("metadata") or {}).get("resourceVersion")
    return str(value) if value else None


def is_serving(pod: dict) -> bool:
    """Running, Ready, addressed and not terminating."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if meta.get("deletionTimestamp") or not status.get("podIP"):
        return False
    if status.get("phase") != "Running":
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in status.get("conditions") or [] if isinstance(c, dict))


def _port(value: object) -> int | None:
    try:
        port = int(str(value).strip())
    except (TypeError, ValueError):
        return None
    return port if 0 < port < 65536 else None


def _named_port(pod: dict, name: str) -> int | None:
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == name:
                return _port(port.get("containerPort"))
    return None


def host_in_url(ip: str) -> str:
    try:
        if isinstance(ipaddress.ip_address(ip), ipaddress.IPv6Address):
            return f"[{ip}]"
    except ValueError:
        pass
    return ip


def target_of(pod: dict, role: str, rules: PodRules = DEFAULT_RULES) -> Target | None:
    """The server a pod stands for, or None while it must not receive requests."""
    if not is_serving(pod):
        return None
    meta = pod.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    labels = meta.get("labels") or {}
    port = (_port(annotations.get(rules.port_annotation))
            or _named_port(pod, rules.port_name) or rules.default_port)
    bootstrap = _port(annotations.get(rules.bootstrap_annotation)) if role == "prefill" else None
    model = labels.get(rules.model_key) or annotations.get(rules.model_key) or None
    return Target(
        url=f"http://{host_in_url(pod['status']['podIP'])}:{port}",
        role=role,
        bootstrap_port=bootstrap,
        model=str(model) if model is not None else None,
        pod=pod_name(pod),
        uid=str(meta.get("uid") or pod_name(pod)),
    )
