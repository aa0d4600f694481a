"""Simulated SGLang servers behind wire taps, and gateways started as real loopback processes.

`Sims` is one prefill and one decode simulator, each behind a `WireTap` (the gateway is given
the taps' URLs, so every request a server receives is recorded). `Gateway` is one gateway
process with the helpers the attacks need: its URL, a client for its scheme, the admin API
from loopback, its metrics. Every wait is a poll with a deadline.
"""

from __future__ import annotations

import contextlib
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.procs import HOST, Proc, free_port, python
from tests.rigs.faults import Metrics
from tests.security.tap import WireTap

START_TIMEOUT = 60.0


def wait_for(predicate: Callable[[], object], timeout: float, what: str,
              interval: float = 0.05) -> float:
    """Poll until `predicate()` is truthy; the seconds it took, or fail naming `what`."""
    started = time.monotonic()
    while True:
        with contextlib.suppress(httpx.HTTPError, OSError):
            if predicate():
                return time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise AssertionError(f"not within {timeout:g}s: {what}")
        time.sleep(interval)


@dataclass
class Sim:
    role: str
    port: int
    proc: Proc
    tap: WireTap
    bootstrap_port: int | None = None

    @property
    def direct(self) -> str:
        return f"http://{HOST}:{self.port}"

    def stats(self) -> dict:
        return httpx.get(self.direct + "/sim/stats", timeout=10).json()

    def rooms(self, rid: str) -> list[dict]:
        return [r for r in self.stats()["rooms"] if r["rid"] == rid]


@dataclass
class Sims:
    prefill: Sim
    decode: Sim

    @property
    def both(self) -> tuple[Sim, Sim]:
        return self.prefill, self.decode

    def server_args(self) -> list[str]:
        return ["--prefill", self.prefill.tap.url, "--decode", self.decode.tap.url]

    def seen(self, path: str | None = None, since: float = 0.0):
        return [s for sim in self.both for s in sim.tap.seen(path, since)]

    def close(self) -> None:
        for sim in self.both:
            sim.proc.stop()
            sim.tap.close()


def start_sims(log_dir: Path, name: str, token_delay: float) -> Sims:
    sims = {}
    for role in ("prefill", "decode"):
        port = free_port()
        argv = python("-m", "backends.sim", "--mode", role, "--host", HOST, "--port", str(port),
                      "--token-delay", str(token_delay), "--bootstrap-timeout", "10",
                      "--waiting-timeout", "10")
        boot = free_port() if role == "prefill" else None
        if boot is not None:
            argv += ["--bootstrap-port", str(boot)]
        proc = Proc(f"{name}-{role}", argv, log_dir)
        sims[role] = Sim(role, port, proc, WireTap(port).start(), boot)
    for sim in sims.values():
        sim.proc.wait_http(sim.direct + "/health", START_TIMEOUT)
    return Sims(sims["prefill"], sims["decode"])


@dataclass
class Gateway:
    name: str
    proc: Proc
    port: int
    scheme: str = "http"
    verify: ssl.SSLContext | bool = True  # a context may carry a client certificate too
    headers: dict = field(default_factory=dict)  # an inference key, when keys are set
    admin_headers: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"{self.scheme}://{HOST}:{self.port}"

    def client(self, headers: dict | None = None, **options) -> httpx.Client:
        options.setdefault("timeout", 30.0)
        options.setdefault("verify", self.verify)
        return httpx.Client(base_url=self.url, headers=headers or {}, **options)

    @property
    def session(self) -> httpx.Client:
        """A kept-alive client of the test's own thread (no default headers)."""
        if getattr(self, "_session", None) is None:
            self._session = self.client()
        return self._session

    def get(self, path: str, headers: dict | None = None, **options) -> httpx.Response:
        return self.session.get(path, headers=headers, **options)

    def post(self, path: str, headers: dict | None = None, **options) -> httpx.Response:
        return self.session.post(path, headers=headers, **options)

    def servers(self) -> dict[str, dict]:
        """GET /admin/servers (from loopback, with the admin key if there is one)."""
        r = self.get("/admin/servers", self.admin_headers)
        r.raise_for_status()
        return {s["url"]: s for s in r.json()["servers"]}

    def in_flight(self) -> int:
        return sum(s["in_flight"] for s in self.servers().values())

    def metrics(self) -> Metrics:
        return Metrics.parse(self.get("/metrics").text)

    def stop(self) -> None:
        if getattr(self, "_session", None) is not None:
            self._session.close()
        self.proc.stop()


def start_gateway(log_dir: Path, name: str, sims: Sims | None, args: Sequence[str] = (),
                  env: dict | None = None, scheme: str = "http",
                  verify: ssl.SSLContext | bool = True, headers: dict | None = None,
                  admin_headers: dict | None = None) -> Gateway:
    """Start `python -m gateway` on a free loopback port and wait until it is ready."""
    port = free_port()
    argv = python("-m", "gateway", "--host", HOST, "--port", str(port))
    argv += sims.server_args() if sims is not None else []
    proc = Proc(name, argv + list(args), log_dir, env)
    gateway = Gateway(name, proc, port, scheme, verify, headers or {}, admin_headers or {})

    def ready() -> bool:
        if proc.popen.poll() is not None:
            raise AssertionError(f"{name} exited with {proc.popen.returncode}:\n{proc.log()}")
        return gateway.get("/readiness", timeout=2.0).status_code == 200

    try:
        wait_for(ready, START_TIMEOUT, f"{name} ready")
    except BaseException:
        proc.stop()
        raise
    return gateway
