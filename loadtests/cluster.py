"""The PD servers behind every target: 1 prefill + N decode, zero compute time.

Two kinds (`--backend`):

* `stub`: `loadtests.pdstub`, one light process that enforces room pairing and answers at
  once (about 30 us of CPU per PD request): the proxy is the bottleneck.
* `sim`: the SGLang simulator (`backends.sim --fast`), one process per server, the full PD
  protocol including the decode-to-prefill KV handshake over HTTP (about 2-3 ms of CPU per PD
  request): realistic, but on one shared core it saturates at a few hundred requests/s.

`stub_farm` is the multi-core form for `loadtests.scaling`: several stub processes, each on
its own core, each one prefill and one decode server.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from loadtests.launch import HOST, free_port, pinned, running

BACKENDS = ("stub", "sim")


@dataclass
class Cluster:
    backend: str
    prefill_ports: list[int]
    bootstrap_port: int  # the one every prefill reports (stub farms share one)
    decode_ports: list[int]
    pids: list[int] = field(default_factory=list)

    @property
    def prefill_port(self) -> int:
        return self.prefill_ports[0]

    @property
    def prefill_url(self) -> str:
        return self.prefill_urls[0]

    @property
    def prefill_urls(self) -> list[str]:
        return [f"http://{HOST}:{port}" for port in self.prefill_ports]

    @property
    def decode_urls(self) -> list[str]:
        return [f"http://{HOST}:{port}" for port in self.decode_ports]


def _sim(mode: str, port: int, bootstrap: int | None) -> list[str]:
    argv = [sys.executable, "-m", "backends.sim", "--mode", mode, "--host", HOST,
            "--port", str(port), "--fast", "--log-level", "warning",
            "--max-running-requests", "4096", "--bootstrap-timeout", "10",
            "--waiting-timeout", "10", "--bootstrap-retries", "3",
            "--bootstrap-retry-interval", "0.2"]
    if bootstrap is not None:
        argv += ["--bootstrap-port", str(bootstrap)]
    return argv


def _stub(prefill: int, bootstrap: int, decodes: list[int], *extra: str) -> list[str]:
    argv = [sys.executable, "-m", "loadtests.pdstub", "--host", HOST,
            "--prefill-port", str(prefill), "--bootstrap-port", str(bootstrap), *extra]
    for port in decodes:
        argv += ["--decode-port", str(port)]
    return argv


@contextlib.contextmanager
def cluster(backend: str, decodes: int, cpu: int | None, log_dir: Path) -> Iterator[Cluster]:
    prefill, bootstrap = free_port(), free_port()
    decode_ports = [free_port() for _ in range(decodes)]
    found = Cluster(backend, [prefill], bootstrap, decode_ports)
    with contextlib.ExitStack() as stack:
        if backend == "stub":
            proc = stack.enter_context(running(
                "pdstub", pinned(_stub(prefill, bootstrap, decode_ports), cpu), log_dir,
                f"{found.prefill_url}/health"))
            found.pids.append(proc.pid)
        elif backend == "sim":
            proc = stack.enter_context(running(
                "sim-prefill", pinned(_sim("prefill", prefill, bootstrap), cpu), log_dir,
                f"{found.prefill_url}/health"))
            found.pids.append(proc.pid)
            for i, (port, url) in enumerate(zip(decode_ports, found.decode_urls, strict=True)):
                proc = stack.enter_context(running(
                    f"sim-decode{i}", pinned(_sim("decode", port, None), cpu), log_dir,
                    f"{url}/health"))
                found.pids.append(proc.pid)
        else:
            raise ValueError(f"unknown backend {backend!r}; choose from {BACKENDS}")
        yield found


@contextlib.contextmanager
def stub_farm(cpus: list[set[int] | None], log_dir: Path) -> Iterator[Cluster]:
    """One stub process per entry of `cpus` (pinned there), each serving one prefill and one
    decode: as many servers of each role as processes, so that no single-threaded stub is the
    bottleneck of a proxy on many cores. A proxy pairs any prefill with any decode, so the
    stubs run `--no-pairing` and share one bootstrap port (loadtests/pdstub.py)."""
    bootstrap = free_port()
    found = Cluster("stub", [], bootstrap, [])
    with contextlib.ExitStack() as stack:
        for i, cpu in enumerate(cpus):
            prefill, decode = free_port(), free_port()
            proc = stack.enter_context(running(
                f"pdstub{i}", pinned(_stub(prefill, bootstrap, [decode], "--no-pairing"), cpu),
                log_dir, f"http://{HOST}:{prefill}/health"))
            found.prefill_ports.append(prefill)
            found.decode_ports.append(decode)
            found.pids.append(proc.pid)
        yield found
