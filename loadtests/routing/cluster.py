"""The simulated PD cluster every routing target is measured against, and its bookkeeping.

Prefill and decode servers are `backends.sim` processes with the default H100 timing model
(not `--fast`) and a finite prefix cache (`--cache-capacity-tokens`, LRU). Each prefill
server publishes its KV cache events on its own loopback ZMQ port, for `prefix_cache`.

DP layouts (`SimOptions.dp_ranks` > 1): every prefill server runs that many DP ranks, as
attention DP (`--dp-size N --enable-dp-attention`, the layout of DeepSeek-class deployments)
or plain DP (`--dp-size N`). `cache_tokens` stays the cache of a server: each rank gets
1/N of it (the simulator's `--cache-capacity-tokens` is per rank, as SGLang's pool is), so a
layout with ranks holds what the one-rank layout holds. Rank r publishes its KV events on the
server's base port + r (SGLang's offset_endpoint_port), so the base is the first of N free
ports. Decode servers keep one rank.

Between targets the cluster is brought back to the same state: wait until no request runs,
`POST /flush_cache` on every server (the sims refuse while requests run), `POST /sim/reset`.
The figures of a target are deltas of the servers' own counters: `sglang:prompt_tokens_total`
and `sglang:cached_tokens_total` from the prefill servers' `/metrics` (the cache hit rate the
servers saw), and the requests each prefill server received (`/sim/stats`).
"""

from __future__ import annotations

import contextlib
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson

from loadtests.launch import HOST, free_port, running

COUNTERS = ("sglang:prompt_tokens_total", "sglang:cached_tokens_total")


@dataclass(frozen=True)
class SimOptions:
    prefills: int = 4
    decodes: int = 4
    cache_tokens: int = 16384  # prefix cache per prefill server
    page_size: int = 1  # SGLang's default
    dp_ranks: int = 1  # DP ranks per prefill server
    attn_dp: bool = True  # the ranks are attention DP (else plain DP); only with dp_ranks > 1
    sim_flags: tuple[str, ...] = ()  # more `backends.sim` flags for every server (timing)

    @property
    def layout(self) -> str:
        if self.dp_ranks == 1:
            return "1 rank"
        return f"{'attention' if self.attn_dp else 'plain'} DP x{self.dp_ranks}"


@dataclass
class SimServer:
    """One `backends.sim` server on loopback: its role and ports. Shared with the fault-test
    rig (tests/rigs/faults.py), which adds its process and restarts."""

    role: str
    port: int
    bootstrap_port: int | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def argv(self, *flags: str) -> list[str]:
        """The command that serves this role on these ports, with `flags` after."""
        argv = [sys.executable, "-m", "backends.sim", "--mode", self.role, "--host", HOST,
                "--port", str(self.port)]
        if self.bootstrap_port is not None:
            argv += ["--bootstrap-port", str(self.bootstrap_port)]
        return argv + list(flags)


@dataclass
class Server(SimServer):
    kv_events_port: int | None = None
    pid: int = 0

    @property
    def kv_events_endpoint(self) -> str:
        return f"tcp://{HOST}:{self.kv_events_port}"


@dataclass
class Cluster:
    options: SimOptions
    prefills: list[Server] = field(default_factory=list)
    decodes: list[Server] = field(default_factory=list)

    @property
    def servers(self) -> list[Server]:
        return self.prefills + self.decodes

    @property
    def pids(self) -> list[int]:
        return [s.pid for s in self.servers]


def sim_argv(server: Server, options: SimOptions) -> list[str]:
    flags = ["--log-level", "warning", "--page-size", str(options.page_size),
             "--bootstrap-timeout", "10", "--waiting-timeout", "10"]
    if server.role == "prefill":
        events = {"publisher": "zmq", "endpoint": server.kv_events_endpoint,
                  "topic": "kv-events", "bind": True}
        flags += ["--cache-capacity-tokens", str(options.cache_tokens // options.dp_ranks),
                  "--kv-events-config", orjson.dumps(events).decode()]
        if options.dp_ranks > 1:
            flags += ["--dp-size", str(options.dp_ranks)]
            flags += ["--enable-dp-attention"] if options.attn_dp else []
    return server.argv(*flags, *options.sim_flags)


def free_ports(count: int, taken: set[int]) -> int:
    """The first of `count` consecutive free loopback ports, none of them in `taken` (which
    gains them): the ports are only probed, so later picks must not reuse them."""
    for _ in range(200):
        base = free_port()
        ports = range(base, base + count)
        if taken.isdisjoint(ports) and all(_bindable(p) for p in ports[1:]):
            taken.update(ports)
            return base
    raise RuntimeError(f"no {count} consecutive free ports found")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


@contextlib.contextmanager
def sim_cluster(options: SimOptions, log_dir: Path) -> Iterator[Cluster]:
    cluster = Cluster(options)
    taken: set[int] = set()
    cluster.prefills = [Server("prefill", free_ports(1, taken), free_ports(1, taken),
                               free_ports(options.dp_ranks, taken))
                        for _ in range(options.prefills)]
    cluster.decodes = [Server("decode", free_ports(1, taken)) for _ in range(options.decodes)]
    with contextlib.ExitStack() as stack:
        procs = [(server, stack.enter_context(running(
                     f"sim-{server.role}{i}", sim_argv(server, options), log_dir, None)))
                 for role in (cluster.prefills, cluster.decodes)
                 for i, server in enumerate(role)]
        for server, proc in procs:  # started all at once, then waited for
            proc.wait_ready(f"{server.url}/health", 60.0)
            server.pid = proc.pid
        yield cluster


def _get(client: httpx.Client, url: str) -> httpx.Response:
    response = client.get(url)
    response.raise_for_status()
    return response


def in_flight(client: httpx.Client, cluster: Cluster) -> int:
    return sum(_get(client, f"{s.url}/sim/stats").json()["in_flight"] for s in cluster.servers)


def settle(cluster: Cluster, timeout: float = 30.0) -> None:
    """Wait until no server has work, then flush every prefix cache and reset the counters."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=5.0) as client:
        pending = list(cluster.servers)
        while pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"servers still busy after {timeout}s: "
                                   f"{[s.url for s in pending]}")
            server = pending[0]
            busy = _get(client, f"{server.url}/sim/stats").json()["in_flight"]
            flushed = not busy and client.post(f"{server.url}/flush_cache").status_code == 200
            if flushed:
                client.post(f"{server.url}/sim/reset").raise_for_status()
                pending.pop(0)
            else:
                time.sleep(0.2)


def _counter(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass(frozen=True)
class Snapshot:
    """Counters of the prefill servers at one moment."""

    prompt_tokens: dict[str, float]
    cached_tokens: dict[str, float]
    requests: dict[str, int]  # generation requests received since the last reset
    ranks: dict[str, list[tuple[int, int, int]]]  # per DP rank: (requests, prompt, cached)


def snapshot(cluster: Cluster) -> Snapshot:
    prompt, cached, requests, ranks = {}, {}, {}, {}
    with httpx.Client(timeout=5.0) as client:
        for server in cluster.prefills:
            text = _get(client, f"{server.url}/metrics").text
            prompt[server.url] = _counter(text, COUNTERS[0])
            cached[server.url] = _counter(text, COUNTERS[1])
            stats = _get(client, f"{server.url}/sim/stats").json()
            requests[server.url] = stats["received"]
            ranks[server.url] = [(r["requests"], r["prompt_tokens"], r["cached_tokens"])
                                 for r in stats["dp_ranks"]]
    return Snapshot(prompt, cached, requests, ranks)


@dataclass(frozen=True)
class ServerFigures:
    prompt_tokens: float
    cached_tokens: float
    requests: dict[str, int]  # per prefill server, in cluster order
    # per prefill server, per DP rank: (requests served, prompt tokens, cached tokens)
    ranks: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def difference(before: Snapshot, after: Snapshot) -> ServerFigures:
    prompt = sum(after.prompt_tokens[u] - before.prompt_tokens[u] for u in after.prompt_tokens)
    cached = sum(after.cached_tokens[u] - before.cached_tokens[u] for u in after.cached_tokens)
    ranks = {url: [tuple(a - b for a, b in zip(now, then, strict=True))
                   for now, then in zip(after.ranks[url], before.ranks[url], strict=True)]
             for url in after.ranks}
    return ServerFigures(prompt, cached, dict(after.requests), ranks)
