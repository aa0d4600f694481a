"""A simulated PD cluster (1 prefill + 2 decode) and the gateway in front, as real processes."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import httpx
import pytest

from tests.procs import HOST, free_port, python, running

# every knob of /sim/faults: a stall or a cut left on by one test stalled the next (a test
# asking after `test_decode_stalling_mid_stream...` got 504s)
NO_FAULTS = {"error_rate": 0.0, "hang": False, "crash_after": 0, "slow_start": 0.0,
             "health_fail": False, "first_token_delay": 0.0, "fail_bootstrap_port": 0,
             "truncate_rate": 0.0, "stall_after": 0, "withhold_kv": False}
SIM_FAST = ["--bootstrap-timeout", "5", "--waiting-timeout", "5",
            "--bootstrap-retries", "3", "--bootstrap-retry-interval", "0.2"]


@dataclass
class Cluster:
    gateway: str
    prefill: list[tuple[str, int]]
    decode: list[str]
    null: str | None = None
    procs: dict = field(default_factory=dict)

    def stats(self, url: str) -> dict:
        return httpx.get(url + "/sim/stats", timeout=5).json()

    def reset(self) -> None:
        for url in [p for p, _ in self.prefill] + self.decode:
            httpx.post(url + "/sim/reset", timeout=5)
            httpx.post(url + "/sim/faults", json=NO_FAULTS, timeout=5).raise_for_status()


def sim(mode: str, port: int, bootstrap: int | None = None, *extra: str) -> list[str]:
    argv = python("-m", "backends.sim", "--mode", mode, "--host", HOST, "--port", str(port),
                  *SIM_FAST, *extra)
    if bootstrap is not None:
        argv += ["--bootstrap-port", str(bootstrap)]
    return argv


@contextlib.contextmanager
def sim_cluster(log_dir, n_prefill=1, n_decode=2, gateway_args=(), sim_args=(), null=False):
    with contextlib.ExitStack() as stack:
        prefill, decode, procs = [], [], {}
        for i in range(n_prefill):
            port, boot = free_port(), free_port()
            url = f"http://{HOST}:{port}"
            procs[url] = stack.enter_context(running(
                f"prefill{i}", sim("prefill", port, boot, *sim_args), log_dir, url + "/health"))
            prefill.append((url, boot))
        for i in range(n_decode):
            port = free_port()
            url = f"http://{HOST}:{port}"
            procs[url] = stack.enter_context(running(
                f"decode{i}", sim("decode", port, None, *sim_args), log_dir, url + "/health"))
            decode.append(url)
        null_url = None
        if null:
            port = free_port()
            null_url = f"http://{HOST}:{port}"
            stack.enter_context(running("null", sim("null", port), log_dir, null_url + "/health"))
        gw_port = free_port()
        argv = python("-m", "gateway", "--host", HOST, "--port", str(gw_port))
        for url, boot in prefill:
            argv += ["--prefill", url, str(boot)]
        for url in decode:
            argv += ["--decode", url]
        gateway = f"http://{HOST}:{gw_port}"
        procs["gateway"] = stack.enter_context(running(
            "gateway", argv + list(gateway_args), log_dir, gateway + "/readiness"))
        yield Cluster(gateway, prefill, decode, null_url, procs)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with sim_cluster(tmp_path_factory.mktemp("logs"), null=True,
                     gateway_args=["--max-body-bytes", "1000000"]) as c:
        yield c


@pytest.fixture
def fresh(cluster):
    cluster.reset()
    return cluster
