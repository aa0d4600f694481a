"""The real gateway process discovering simulated SGLang servers through the fake API.

The "pods" the fake API reports have podIP 127.0.0.1 and the sims' ports in the
`sglang.ai/port` annotation. Skipped until gateway/config/settings.py has the discovery settings.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import time

import httpx
import pytest

from gateway.config.settings import GatewayConfig
from tests.discovery.fakekube import ThreadedFakeKube, make_pod
from tests.integration.conftest import sim
from tests.procs import HOST, free_port, python, running

WIRED = "prefill_selector" in {f.name for f in dataclasses.fields(GatewayConfig)}
pytestmark = pytest.mark.skipif(
    not WIRED, reason="discovery is not wired into gateway/config/settings.py and gateway/runtime.py "
    "yet (no --prefill-selector)")
NAMESPACE = "inference"
BODY = {"text": "hello discovery", "sampling_params": {"max_new_tokens": 4}}


def sim_pod(name: str, role: str, port: int, bootstrap: int | None = None) -> dict:
    annotations = {"sglang.ai/port": str(port)}
    if bootstrap is not None:
        annotations["sglang.ai/bootstrap-port"] = str(bootstrap)
    return make_pod(name, role=role, ip=HOST, annotations=annotations)


def servers(gateway: str) -> dict[str, dict]:
    answer = httpx.get(gateway + "/admin/servers", timeout=5).json()
    return {s["url"]: s for s in answer["servers"]}


def wait_for(check, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            result = check()
            if result:
                return result
        time.sleep(0.05)
    raise AssertionError(f"{what} not reached within {timeout}s")


def test_gateway_follows_the_pods(tmp_path):
    with contextlib.ExitStack() as stack:
        fake = stack.enter_context(ThreadedFakeKube())
        ports = {"p0": (free_port(), free_port()), "d0": (free_port(), None),
                 "d1": (free_port(), None)}
        urls = {name: f"http://{HOST}:{port}" for name, (port, _) in ports.items()}
        for name, (port, boot) in ports.items():
            role = "prefill" if name.startswith("p") else "decode"
            stack.enter_context(running(name, sim(role, port, boot), tmp_path,
                                        urls[name] + "/health"))
            fake.call(fake.fake.add, sim_pod(name, role, port, boot), NAMESPACE)
        port = free_port()
        gateway = f"http://{HOST}:{port}"
        argv = python("-m", "gateway", "--host", HOST, "--port", str(port),
                      "--k8s-api-server", fake.url, "--namespace", NAMESPACE,
                      "--prefill-selector", "app=sglang,role=prefill",
                      "--decode-selector", "app=sglang,role=decode",
                      "--k8s-drain-timeout", "20", "--health-interval", "0.5")
        stack.enter_context(running("gateway", argv, tmp_path, gateway + "/readiness"))

        listed = servers(gateway)
        assert set(listed) == set(urls.values())
        assert listed[urls["p0"]]["bootstrap_port"] == ports["p0"][1]
        assert httpx.post(gateway + "/generate", json=BODY, timeout=30).status_code == 200

        # a decode pod turns unready: it leaves rotation within seconds
        fake.call(fake.fake.set_ready, "d1", False, NAMESPACE)
        wait_for(lambda: urls["d1"] not in servers(gateway), what="d1 removed")

        # d0 is deleted while it serves a slow request: the request still completes,
        # and d0 leaves only afterwards; d1, ready again, takes the new requests
        httpx.post(urls["d0"] + "/sim/faults", json={"first_token_delay": 2.0},
                   timeout=5).raise_for_status()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            slow = pool.submit(httpx.post, gateway + "/generate", json=BODY, timeout=30)
            wait_for(lambda: servers(gateway)[urls["d0"]]["in_flight"] == 1,
                     what="request in flight on d0")
            fake.call(fake.fake.delete, "d0", NAMESPACE)
            fake.call(fake.fake.set_ready, "d1", True, NAMESPACE)
            wait_for(lambda: servers(gateway)[urls["d0"]]["draining"], what="d0 draining")
            wait_for(lambda: urls["d1"] in servers(gateway), what="d1 back")
            assert slow.result().status_code == 200
        wait_for(lambda: urls["d0"] not in servers(gateway), what="d0 removed after its request")
        assert httpx.post(gateway + "/generate", json=BODY, timeout=30).status_code == 200

        # without a prefill pod the gateway is not ready; with one again, it is
        fake.call(fake.fake.delete, "p0", NAMESPACE)
        wait_for(lambda: httpx.get(gateway + "/readiness", timeout=5).status_code == 503,
                 what="not ready without prefill")
        fake.call(fake.fake.add, sim_pod("p0", "prefill", *ports["p0"]), NAMESPACE)
        wait_for(lambda: httpx.get(gateway + "/readiness", timeout=5).status_code == 200,
                 what="ready again")
        assert httpx.post(gateway + "/generate", json=BODY, timeout=30).status_code == 200


def test_pods_of_two_models_are_two_pools(tmp_path):
    """The pods' `sglang.ai/model` label names their model (over the name the sims report):
    one selector per role finds the pods of both models, and `model` picks the pool."""
    with contextlib.ExitStack() as stack:
        fake = stack.enter_context(ThreadedFakeKube())
        urls: dict[str, dict[str, str]] = {}
        for model in ("alpha", "beta"):
            for role in ("prefill", "decode"):
                port, boot = free_port(), free_port() if role == "prefill" else None
                url = f"http://{HOST}:{port}"
                name = f"{model}-{role}"
                stack.enter_context(running(name, sim(role, port, boot, "--model-name",
                                                      f"served-{model}"), tmp_path, url + "/health"))
                pod = sim_pod(name, role, port, boot)
                pod["metadata"]["labels"]["sglang.ai/model"] = model
                fake.call(fake.fake.add, pod, NAMESPACE)
                urls.setdefault(model, {})[role] = url
        port = free_port()
        gateway = f"http://{HOST}:{port}"
        argv = python("-m", "gateway", "--host", HOST, "--port", str(port),
                      "--k8s-api-server", fake.url, "--namespace", NAMESPACE,
                      "--prefill-selector", "app=sglang,role=prefill",
                      "--decode-selector", "app=sglang,role=decode")
        stack.enter_context(running("gateway", argv, tmp_path, gateway + "/readiness"))
        wait_for(lambda: len(servers(gateway)) == 4, what="four pods registered")
        assert {s["url"]: s["model"] for s in servers(gateway).values()} == {
            u: model for model, roles in urls.items() for u in roles.values()}
        for model, count in (("alpha", 3), ("beta", 2)):
            for _ in range(count):
                r = httpx.post(gateway + "/generate", json={**BODY, "model": model}, timeout=30)
                assert r.status_code == 200, r.text
        listed = servers(gateway)
        for model, count in (("alpha", 3), ("beta", 2)):
            for url in urls[model].values():
                assert listed[url]["total_requests"] == count
        ids = [c["id"] for c in httpx.get(gateway + "/v1/models", timeout=5).json()["data"]]
        assert ids == ["alpha", "beta"]  # named by the label, not the servers' own names
        assert httpx.post(gateway + "/generate", json={**BODY, "model": "served-alpha"},
                          timeout=30).status_code == 404
