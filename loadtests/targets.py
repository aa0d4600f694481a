"""What is measured: the floor (no proxy), our gateway in several configurations, and the peers.

`gateway` is the default configuration (`gateway-base`: the same, from another checkout, for an
A/B of two commits in one run); `gateway-own`, `gateway-aiohttp` and `gateway-httpx`
pin the data-path client (`--upstream-client fast|aiohttp|httpx`) so that one run compares
the three side by side (`report.clients_table`). `gateway-tracing` is the default with
tracing on for every request (sample ratio 1), exporting over OTLP/HTTP to a real collector
on loopback that discards what it receives (`rotel --exporter blackhole`, started beside it
on the load generator's CPU): the gateway pays for making, encoding and sending every span.

A target may need a helper process for its lifetime (`sidecar`: a context manager that
starts it and yields the extra arguments of the target's command line).

A target is a name, whether it needs the peers' venv, and how to build its command line for a
cluster and a port. Every proxy listens on 127.0.0.1 and logs at warning level where it can
(mini_lb cannot be told: it logs one access line per request, as shipped).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from loadtests.cluster import Cluster
from loadtests.launch import HOST, free_port, pinned, running


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    argv: Callable[[Cluster, int, Path | None], list[str]] | None  # None: the floor
    peer: bool = False
    ours: bool = False
    ready_path: str = "/health"
    # (log dir, CPU) -> a context manager yielding extra arguments
    sidecar: Callable[[Path, int | None], contextlib.AbstractContextManager[list[str]]] | None = None


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


def _gateway_base(c: Cluster, port: int, peer_python: Path | None) -> list[str]:
    """The gateway of another checkout (`GATEWAY_BASE`: a folder holding its `gateway/`
    package), run by this interpreter ahead of this checkout's: an A/B of two commits in one
    run, round by round on the same CPUs."""
    base = os.environ.get("GATEWAY_BASE")
    if not base:
        raise SystemExit("target gateway-base needs GATEWAY_BASE=<folder holding gateway/>")
    start = (f"import runpy, sys; sys.path.insert(0, {str(Path(base).resolve())!r}); "
             "runpy.run_module('gateway', run_name='__main__', alter_sys=True)")
    return [sys.executable, "-c", start, *_gateway()(c, port, peer_python)[3:]]


def _python_floor(c: Cluster, port: int, _peer_python: Path | None) -> list[str]:
    args = [sys.executable, "-m", "loadtests.pd_floor", "--host", HOST, "--port", str(port),
            "--prefill", c.prefill_urls[0], str(c.bootstrap_port)]
    for url in c.decode_urls:
        args += ["--decode", url]
    return args


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


def _tokenizer_dir() -> str:
    """A tiny served model's tokenizer (backends/tiny_tokenizer.py), made once per run."""
    global _TOKENIZER
    if _TOKENIZER is None:
        from backends.tiny_tokenizer import train, write_model  # noqa: PLC0415 - this target only

        _TOKENIZER = str(write_model(Path(tempfile.mkdtemp(prefix="tok-")) / "model", train()))
    return _TOKENIZER


_TOKENIZER: str | None = None


def _gateway_tokenizer(c: Cluster, port: int, peer_python: Path | None) -> list[str]:
    return _gateway("--tokenizer", _tokenizer_dir(), "--prefill-policy", "prefix_cache")(
        c, port, peer_python)


@contextlib.contextmanager
def otlp_blackhole(log_dir: Path, cpu: int | None) -> Iterator[list[str]]:
    """rotel (a real OTLP collector, PyPI package `rotel`) receiving OTLP/HTTP on loopback and
    discarding it; yields the gateway flags that export to it."""
    spec = importlib.util.find_spec("rotel")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("gateway-tracing needs the rotel collector: pip install -e '.[dev]'")
    agent = Path(next(iter(spec.submodule_search_locations))) / "rotel-agent"
    port = free_port()
    argv = [str(agent), "start", "--otlp-http-endpoint", f"{HOST}:{port}",
            "--otlp-grpc-endpoint", f"{HOST}:{free_port()}", "--exporter", "blackhole"]
    with running("otlp-blackhole", pinned(argv, cpu), log_dir, None) as proc:
        proc.wait_output("Starting Rotel", 15)
        yield ["--otlp-endpoint", f"http://{HOST}:{port}/v1/traces"]


TARGETS: dict[str, Target] = {t.name: t for t in [
    Target("floor", "no proxy: the load generator sends both PD legs itself", None),
    Target("gateway", "our gateway, default policies (cache_aware prefill, least_load decode)",
           _gateway(), ours=True, ready_path="/readiness"),
    Target("gateway-base", "our gateway at another checkout (GATEWAY_BASE), default policies",
           _gateway_base, ours=True, ready_path="/readiness"),
    Target("gateway-tokenizer", "our gateway, prefix_cache prefill with the model's tokenizer "
           "(a tiny model's): every prompt tokenized", _gateway_tokenizer, ours=True,
           ready_path="/readiness"),
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
    Target("gateway-tracing", "our gateway, every request traced, OTLP/HTTP to a local "
           "collector that discards (rotel)", _gateway(), ours=True, ready_path="/readiness",
           sidecar=otlp_blackhole),
    Target("gateway-tracing-10", "gateway-tracing with --otlp-sample-ratio 0.1 (one request "
           "in ten recorded)", _gateway("--otlp-sample-ratio", "0.1"), ours=True,
           ready_path="/readiness", sidecar=otlp_blackhole),
    Target("python-floor", "the least a Python PD proxy does, on the gateway's server "
           "protocol and client (loadtests/pd_floor.py): a measuring stick", _python_floor,
           ours=True),
    Target("sglang-router", "sglang-router 0.3.2 (Rust), --policy random",
           _rust_router, peer=True, ready_path="/readiness"),
    Target("mini-lb", "sglang-router 0.3.2 --mini-lb (Python, FastAPI + aiohttp)",
           _router("--mini-lb", "--policy", "random"), peer=True),
]}
