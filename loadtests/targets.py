"""What is measured: the floor (no proxy), our gateway in several configurations, and the peers.

`gateway` is the default configuration; `gateway-own`, `gateway-aiohttp` and `gateway-httpx`
pin the data-path client (`--upstream-client fast|aiohttp|httpx`) so that one run compares
the three side by side (`report.clients_table`).

A target is a name, whether it needs the peers' venv, and how to build its command line for a
cluster and a port. Every proxy listens on 127.0.0.1 and logs at warning level where it can
(mini_lb cannot be told: it logs one access line per request, as shipped).
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from loadtests.cluster import Cluster
from loadtests.launch import HOST, free_port


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    argv: Callable[[Cluster, int, Path | None], list[str]] | None  # None: the floor
    peer: bool = False
    ours: bool = False
    ready_path: str = "/health"


def _gateway(*extra: str):
    def argv(c: Cluster, port: int, _peer_python: Path | None) -> list[str]:
        args = [sys.executable, "-m", "gateway", "--host", HOST, "--port", str(port),
                "--log-level", "warning"]
        for url in c.prefill_urls:
            args += ["--prefill", url, str(c.bootstrap_port)]
        for url in c.decode_urls:
            args += ["--decode", url]
        return args + list(extra)
    return argv


def _router(*extra: str):
    def argv(c: Cluster, port: int, peer_python: Path | None) -> list[str]:
        args = [str(peer_python), "-m", "sglang_router.launch_router", "--pd-disaggregation",
                "--host", HOST, "--port", str(port)]
        for url in c.prefill_urls:
            args += ["--prefill", url, str(c.bootstrap_port)]
        for url in c.decode_urls:
            args += ["--decode", url]
        return args + list(extra)
    return argv


def _rust_router(c: Cluster, port: int, peer_python: Path | None) -> list[str]:
    # Prometheus would bind 0.0.0.0:29000 by default: loopback and a free port instead.
    return _router("--policy", "random", "--log-level", "warn",
                   "--prometheus-host", HOST, "--prometheus-port", str(free_port()),
                   )(c, port, peer_python)


TARGETS: dict[str, Target] = {t.name: t for t in [
    Target("floor", "no proxy: the load generator sends both PD legs itself", None),
    Target("gateway", "our gateway, default policies (cache_aware prefill, least_load decode)",
           _gateway(), ours=True, ready_path="/readiness"),
    Target("gateway-rr", "our gateway, --policy round_robin",
           _gateway("--policy", "round_robin"), ours=True, ready_path="/readiness"),
    Target("gateway-accesslog", "our gateway, --access-log to a file (one JSON line per request)",
           _gateway("--access-log", str(Path(tempfile.gettempdir()) / "gateway-bench-access.log")),
           ours=True, ready_path="/readiness"),
    Target("gateway-own", "our gateway, --upstream-client fast (the own HTTP/1.1 client)",
           _gateway("--upstream-client", "fast"), ours=True, ready_path="/readiness"),
    Target("gateway-aiohttp", "our gateway, --upstream-client aiohttp",
           _gateway("--upstream-client", "aiohttp"), ours=True, ready_path="/readiness"),
    Target("gateway-httpx", "our gateway, --upstream-client httpx",
           _gateway("--upstream-client", "httpx"), ours=True, ready_path="/readiness"),
    Target("sglang-router", "sglang-router 0.3.2 (Rust), --policy random",
           _rust_router, peer=True, ready_path="/readiness"),
    Target("mini-lb", "sglang-router 0.3.2 --mini-lb (Python, FastAPI + aiohttp)",
           _router("--mini-lb", "--policy", "random"), peer=True),
]}
