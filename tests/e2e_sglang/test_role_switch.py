"""Role switch on real SGLang 0.5.23 (CPU rig): servers launched with `--enable-pd-role-switch`
(the topology's `enable_pd_role_switch`), a decode switched to prefill and back through
POST /admin/servers/role while light traffic runs, with no failed request.

Its own cluster (the session one runs without the flag): the CPU-rig topology with the flag,
1 prefill + 2 decodes, launched by the gateway. SGLang's own answers are checked first
(prepare_only on an idle server), so a CPU build that cannot switch stops at a named step.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.e2e_sglang.conftest import (
    MODEL_NAME,
    TOPOLOGY_FILE,
    make_model,
    require_rig,
    start_gateway,
)
from tests.procs import Proc

pytestmark = pytest.mark.timeout(1500)


class Traffic(threading.Thread):
    """One client sending small requests one after another through the gateway."""

    def __init__(self, gateway: str) -> None:
        super().__init__(daemon=True)
        self.gateway = gateway
        self.stop = threading.Event()
        self.ok = 0
        self.failed: list[str] = []

    def run(self) -> None:
        with httpx.Client(timeout=120) as client:
            n = 0
            while not self.stop.is_set():
                n += 1
                # each prompt starts with its own number: no cached prefix ties the traffic to
                # the first prefill, so a server switched to prefill gets its share
                body = ({"text": f"{n} count", "sampling_params": {"max_new_tokens": 8}}
                        if n % 2 else
                        {"model": MODEL_NAME, "max_tokens": 8,
                         "messages": [{"role": "user", "content": f"{n} say"}]})
                path = "/generate" if n % 2 else "/v1/chat/completions"
                try:
                    r = client.post(self.gateway + path, json=body)
                    if r.status_code == 200:
                        self.ok += 1
                    else:
                        self.failed.append(f"{path} {r.status_code} {r.text[:300]}")
                except httpx.HTTPError as exc:
                    self.failed.append(f"{path} {type(exc).__name__}: {exc}")


def topology_with_flag(out: Path) -> Path:
    """deploy/cpu-rig/topology.yaml with enable_pd_role_switch, written where the test runs."""
    text = TOPOLOGY_FILE.read_text().replace("${TOPOLOGY_DIR}", str(TOPOLOGY_FILE.parent))
    spec = yaml.safe_load(text)
    spec["enable_pd_role_switch"] = True
    path = out / "topology-role-switch.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Proc, Path]]:
    require_rig()
    model = make_model(tmp_path_factory.mktemp("tiny-model"))
    root = os.environ.get("SGLANG_E2E_LOG_DIR")
    logs = Path(root) / "role-switch" if root else tmp_path_factory.mktemp("role-switch-logs")
    logs.mkdir(parents=True, exist_ok=True)
    proc, url = start_gateway(model, logs, topology_with_flag(logs))
    try:
        yield url, proc, logs
    finally:
        proc.stop(grace=60)


def servers(gateway: str) -> dict[str, dict]:
    return {s["url"]: s for s in httpx.get(gateway + "/admin/servers", timeout=30)
            .json()["servers"]}


def live_role(url: str) -> str:
    """The role a server runs now: its schedulers' (SGLang's top-level /server_info field is
    the launch configuration, which a switch leaves as it was); /model_info agrees."""
    info = httpx.get(url + "/server_info", timeout=30).json()
    role = info["internal_states"][0]["disaggregation_mode"]
    assert httpx.get(url + "/model_info", timeout=30).json()["disaggregation_mode"] == role
    return role


def wait_served(gateway: str, url: str, role: str, at_least: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snap = servers(gateway)[url]
        if snap["role"] == role and snap["total_requests"] >= at_least:
            return
        time.sleep(0.5)
    raise AssertionError(f"{url} served fewer than {at_least} requests as {role}: {snap}")


def test_switch_a_decode_both_ways_under_light_traffic(cluster):
    gateway, proc, logs = cluster
    listed = servers(gateway)
    decodes = sorted(u for u, s in listed.items() if s["role"] == "decode")
    flipper = decodes[1]
    # SGLang's own check first, the server idle: prepare_only answers "ready", nothing flips
    ready = httpx.post(flipper + "/pd_role_switch", timeout=120,
                       json={"new_role": "prefill", "prepare_only": True})
    assert ready.status_code == 200, ready.text
    assert ready.json()["message"] == "ready" and ready.json()["safe_to_restore"] is True
    assert live_role(flipper) == "decode"
    traffic = Traffic(gateway)
    traffic.start()
    try:
        to_prefill = httpx.post(gateway + "/admin/servers/role", timeout=600,
                                json={"url": flipper, "role": "prefill", "deadline": 120})
        assert to_prefill.status_code == 200, (to_prefill.text, proc.log()[-3000:])
        snap = to_prefill.json()["server"]
        info = httpx.get(flipper + "/server_info", timeout=30).json()
        assert live_role(flipper) == "prefill"
        assert snap["bootstrap_port"] == info["disaggregation_bootstrap_port"]
        wait_served(gateway, flipper, "prefill", 2, 300)
        back = httpx.post(gateway + "/admin/servers/role", timeout=600,
                          json={"url": flipper, "role": "decode", "deadline": 120})
        assert back.status_code == 200, (back.text, proc.log()[-3000:])
        assert live_role(flipper) == "decode"
        wait_served(gateway, flipper, "decode", 2, 300)
    finally:
        traffic.stop.set()
        traffic.join(180)
    assert not traffic.failed, traffic.failed[:5]
    assert traffic.ok >= 8, traffic.ok
