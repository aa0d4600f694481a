"""The proxies compared on routing quality: our gateway per prefill policy, and the peers.

A target name is `gateway:<prefill policy>` (decode: least_load), `sglang-router:<policy>`
(sglang-router 0.3.2, Rust, `--policy` for both roles, as its users run it) or `mini-lb`
(the same wheel's Python balancer, random pairs). `sglang-router:cache_aware+dp-aware` adds
`--dp-aware` (one worker per DP rank, `url@rank`); in PD mode 0.3.2 then sends the decode leg
to `http://0.0.0.0/generate` and fails every request, so it is in no default list. Every
proxy listens on 127.0.0.1; a peer runs from the peers' venv (`loadtests/peers.py`).
`oracle` is no proxy: the load generator routes by the plan's structure and sends both PD
legs itself (`loadtests/routing/oracle.py`); it exists for plans with shared prefixes.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import orjson

from loadtests.launch import HOST, free_port
from loadtests.routing.cluster import Cluster

GATEWAY_POLICIES = ("cache_aware", "prefix_cache", "min_ttft", "least_load", "round_robin",
                    "random", "slo")
ROUTER_POLICIES = ("cache_aware", "power_of_two", "random")
ALL = ([f"gateway:{p}" for p in GATEWAY_POLICIES]
       + [f"sglang-router:{p}" for p in ROUTER_POLICIES] + ["mini-lb"])
# `@wN`: the gateway with `--workers N` (the hit ratio must survive N processes that share
# no prefix tree: docs/WORKERS.md)
WORKERS = ["gateway:cache_aware@w4", "gateway:prefix_cache@w4"]
KNOWN = ALL + WORKERS + ["sglang-router:round_robin", "sglang-router:cache_aware+dp-aware",
                         "oracle"]
QUICK = ["gateway:cache_aware", "gateway:round_robin"]
CAPACITY_POLICIES = ("cache_aware", "prefix_cache", "slo")  # take option cache_tokens
# DP ranks: our default (cache_aware) and exact-index policies against the peers
DP = ["gateway:cache_aware", "gateway:prefix_cache", "sglang-router:cache_aware",
      "sglang-router:round_robin", "mini-lb"]
QUICK_DP = ["gateway:cache_aware"]
# Harder workloads: our policies that route on prefixes or load, the peers' cache_aware and
# round robin, and the oracle.
HARD = ["gateway:cache_aware", "gateway:prefix_cache", "gateway:min_ttft",
        "gateway:round_robin", "sglang-router:cache_aware", "sglang-router:round_robin",
        "oracle"]
QUICK_HARD = ["gateway:cache_aware", "gateway:round_robin", "oracle"]


@dataclass(frozen=True)
class Target:
    name: str

    @property
    def kind(self) -> str:
        return self.name.split(":", 1)[0]

    @property
    def policy(self) -> str:
        policy = self.name.split(":", 1)[1] if ":" in self.name else "random"
        return policy.split("@", 1)[0]

    @property
    def workers(self) -> int:
        """Serving processes of our gateway (`@wN`), 1 without."""
        _, _, suffix = self.name.partition("@w")
        return int(suffix) if suffix else 1

    @property
    def ours(self) -> bool:
        return self.kind == "gateway"

    @property
    def peer(self) -> bool:
        return self.kind in ("sglang-router", "mini-lb")

    @property
    def proxy(self) -> bool:
        """A process the requests go through (the oracle is none)."""
        return self.kind != "oracle"

    @property
    def ready_path(self) -> str:
        return "/health" if self.kind == "mini-lb" else "/readiness"

    def argv(self, cluster: Cluster, port: int, peer_python: Path | None) -> list[str]:
        if self.ours:
            return _gateway(cluster, port, self.policy) + (
                ["--workers", str(self.workers)] if self.workers > 1 else [])
        policy, _, flag = self.policy.partition("+")
        extra = ["--mini-lb"] if self.kind == "mini-lb" else [
            "--policy", policy, *([f"--{flag}"] if flag else []), "--log-level", "warn",
            # Prometheus would bind 0.0.0.0:29000: loopback and a free port instead.
            "--prometheus-host", HOST, "--prometheus-port", str(free_port())]
        args = [str(peer_python), "-m", "sglang_router.launch_router", "--pd-disaggregation",
                "--host", HOST, "--port", str(port), *extra]
        for server in cluster.prefills:
            args += ["--prefill", server.url, str(server.bootstrap_port)]
        for server in cluster.decodes:
            args += ["--decode", server.url]
        return args


def _gateway(cluster: Cluster, port: int, policy: str) -> list[str]:
    args = [sys.executable, "-m", "gateway", "--host", HOST, "--port", str(port),
            "--log-level", "warning", "--prefill-policy", policy, "--decode-policy", "least_load"]
    for server in cluster.prefills:
        args += ["--prefill", server.url, str(server.bootstrap_port)]
    for server in cluster.decodes:
        args += ["--decode", server.url]
    options: dict = {}
    if policy in CAPACITY_POLICIES:
        # the simulator's cache is smaller than the KV pool its /v1/loads reports (a real
        # server's radix cache is that pool), so the policy is told the cache of a target
        options["cache_tokens"] = cluster.options.cache_tokens // cluster.options.dp_ranks
    if policy == "prefix_cache":
        options["endpoints"] = {s.url: s.kv_events_endpoint for s in cluster.prefills}
    if options:
        args += ["--policy-options", orjson.dumps({policy: options}).decode()]
    return args


def parse_targets(text: str) -> list[Target]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in KNOWN]
    if unknown:
        raise ValueError(f"unknown targets {unknown}; choose from {', '.join(KNOWN)}")
    return [Target(n) for n in names]
