"""Throughput over cores: our gateway with `--workers N` against the Rust router on N cores.

    python -m loadtests.scaling                      # 16 cores: N = 1,2,4,8, four targets
    python -m loadtests.scaling --workers 1,2 --quick --targets gateway    # a 2-core smoke run
    python -m loadtests.scaling --streams --out scaling.json --markdown scaling.md

`loadtests.overhead` measures CPU per request with one load generator on one core; that
cannot keep 8 gateway workers busy. Here the proxy gets N cores of its own (taskset; cores
0..N-1 by default), and the rest of the machine drives it: several zero-cost PD stub
processes (`cluster.stub_farm`, one prefill + one decode each) and K load-generator processes
(`loadgen.py`, C keep-alive connections each, closed loop of small non-streaming /generate
requests), each pinned to its own cores, so that neither is the bottleneck; the CPU table
shows that they were not. Targets (each started afresh for each N):

  gateway            --workers N (one listening socket shared by the workers)
  gateway-reuseport  --workers N --workers-socket reuseport (N >= 2; N = 1 is `gateway`)
  gateway-rr         --workers N --policy round_robin (asked by name): no choice among the
                     servers, a pick as cheap as the router's random: what the default
                     policies cost at N cores
  gateway-prefill-rr, gateway-decode-rr
                     (asked by name) round robin for one role, the default for the other:
                     which role's choice the cost at N cores is
  sglang-router      0.3.2 (Rust), --policy random, pinned to the same N cores, with
                     TOKIO_WORKER_THREADS=N (it has no flag for its worker threads; tokio
                     would also size its pool from the affinity mask)
  mini-lb            sglang-router's Python mini_lb: one process, measured at N = 1 only

Per target and N: requests/s (summed over the load processes), errors, latency p50/p99, the
proxy's CPU-seconds per 1000 requests (utime+stime of its process tree), cores used by the
proxy, the stubs, the load generators and everything else; with `--streams` also SSE
events/s of long chat streams. Scaling efficiency = req/s(N) / (N x req/s(1)).
See docs/BENCHMARKS.md ("Scaling over cores").
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from loadtests import peers, scaling_report
from loadtests.cluster import Cluster, stub_farm
from loadtests.launch import HOST, ROOT, OutOfTime, free_port, pinned, running, stop_after
from loadtests.loadgen import LoadGen, LoadGenBroken, Phase
from loadtests.overhead import PROMPT, STREAM_PROMPT
from loadtests.pdstub import MODEL
from loadtests.report import fmt
from loadtests.scaling_report import Point, make_point
from loadtests.targets import TARGETS as PROXIES

ALL_READY = "workers serving"  # the supervisor's line once every worker serves
# Of the CPUs beside the proxy's, the stubs' share by default: a proxied PD request costs the
# stubs two legs (about 30 us of CPU), the load generator one request (about 15-20 us).
STUB_SHARE = 5 / 8


@dataclass(frozen=True)
class Scaled:
    """A proxy of loadtests.targets, and what giving it N cores changes in its command."""

    name: str
    proxy: str  # its key in loadtests.targets.TARGETS
    flags: Callable[[int], list[str]] = lambda n: []
    env: Callable[[int], dict[str, str]] = lambda n: {}
    only: Callable[[int], bool] = lambda n: True  # the N it is measured at
    all_ready: str | None = None  # output that says all N processes serve (N > 1)
    by_name: bool = False  # measured only when `--targets` names it


def _workers(n: int) -> list[str]:
    return ["--workers", str(n)]


def _round_robin_for(role: str) -> Callable[[int], list[str]]:
    """N workers, round robin for `role`'s choice alone, the default for the other's."""
    return lambda n: [*_workers(n), f"--{role}-policy", "round_robin"]


TARGETS: dict[str, Scaled] = {t.name: t for t in [
    Scaled("gateway", "gateway", flags=_workers, all_ready=ALL_READY),
    Scaled("gateway-reuseport", "gateway",
           flags=lambda n: [*_workers(n), "--workers-socket", "reuseport"],
           only=lambda n: n > 1, all_ready=ALL_READY),
    Scaled("gateway-rr", "gateway-rr", flags=_workers, all_ready=ALL_READY, by_name=True),
    *(Scaled(f"gateway-{role}-rr", "gateway", flags=_round_robin_for(role),
             all_ready=ALL_READY, by_name=True) for role in ("prefill", "decode")),
    Scaled("sglang-router", "sglang-router", env=lambda n: {"TOKIO_WORKER_THREADS": str(n)}),
    Scaled("mini-lb", "mini-lb", only=lambda n: n == 1),
]}
DEFAULT_TARGETS = [t.name for t in TARGETS.values() if not t.by_name]


@dataclass(frozen=True)
class Layout:
    """Which CPUs each part runs on; all None when nothing is pinned."""

    proxy: list[int] | None  # the pool: a proxy at N runs on its first N CPUs
    stubs: list[set[int] | None] = field(default_factory=list)  # one entry per stub process
    loads: list[set[int] | None] = field(default_factory=list)  # one per load process

    def proxy_cpus(self, n: int) -> list[int] | None:
        return self.proxy[:n] if self.proxy else None

    def groups(self, n: int) -> dict[str, list[int] | None]:
        def union(sets):
            return sorted(set().union(*sets)) if sets and all(sets) else None
        return {"proxy": self.proxy_cpus(n), "stubs": union(self.stubs),
                "loads": union(self.loads)}

    def describe(self) -> str:
        if self.proxy is None:
            return (f"nothing pinned: {len(self.stubs)} stub and {len(self.loads)} load "
                    "processes share the machine's CPUs with the proxy")
        g = self.groups(len(self.proxy))
        return (f"proxy on CPUs {self.proxy[0]}..N-1 (of {_span(self.proxy)}), "
                f"{len(self.stubs)} stub processes on CPUs {_span(g['stubs'])}, "
                f"{len(self.loads)} load processes on CPUs {_span(g['loads'])}")


def _span(cpus: list[int] | None) -> str:
    return ",".join(map(str, cpus)) if cpus else "any"


def _spread(procs: int, cores: list[int]) -> list[set[int] | None]:
    """Processes over cores: a share of the cores each, or a core shared in turn."""
    if procs <= len(cores):
        return [set(cores[i::procs]) for i in range(procs)]
    return [{cores[i % len(cores)]} for i in range(procs)]


def plan(cpus: list[int], max_n: int, stub_procs: int | None, load_procs: int | None,
         pin: bool) -> Layout:
    """The proxy on the first `max_n` CPUs, the rest split between stubs and load generators
    (by their process counts); unpinned where fewer than two CPUs would be left."""
    rest = cpus[max_n:]
    if not pin or len(rest) < 2:
        return Layout(None, [None] * (stub_procs or 1), [None] * (load_procs or 1))
    stubs = stub_procs or min(len(rest) - 1, max(1, round(len(rest) * STUB_SHARE)))
    loads = load_procs or max(1, len(rest) - stubs)
    share = max(1, min(len(rest) - 1, round(len(rest) * stubs / (stubs + loads))))
    return Layout(cpus[:max_n], _spread(stubs, rest[:share]), _spread(loads, rest[share:]))


def topology(cpus: list[int]) -> str:
    """Which of `cpus` are hyperthreads of one physical core (sysfs): a proxy given two of
    them has less than two cores, which a scaling figure must say."""
    cores: dict[str, list[int]] = {}
    for cpu in cpus:
        path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        try:
            cores.setdefault(path.read_text().strip(), []).append(cpu)
        except OSError:
            return "core topology unknown"
    shared = [group for group in cores.values() if len(group) > 1]
    if not shared:
        return "no two of them share a physical core"
    return "hyperthreads of one core: " + "; ".join(_span(group) for group in shared)


def _ints(text: str) -> list[int]:
    out: list[int] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        low, _, high = part.partition("-")
        out += list(range(int(low), int(high or low) + 1))
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtests.scaling", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", default="1,2,4,8", help="the N measured (default: 1,2,4,8)")
    p.add_argument("--targets", default=",".join(DEFAULT_TARGETS),
                   help=f"comma-separated, from {', '.join(TARGETS)} (default: "
                        f"{', '.join(DEFAULT_TARGETS)})")
    p.add_argument("--duration", type=float,
                   help="measured seconds per phase (default: 4; --quick: 1.5)")
    p.add_argument("--warmup", type=float,
                   help="seconds before each window (default: 1; --quick: 0.5)")
    p.add_argument("--connections", type=int,
                   help="connections per load process (default: 96; --quick: 16)")
    p.add_argument("--stub-procs", type=int, help="stub processes (default: 5/8 of the CPUs "
                   "beside the proxy's, one each; 1 when nothing is pinned)")
    p.add_argument("--load-procs", type=int,
                   help="load processes (default: the other CPUs beside the proxy's, one each)")
    p.add_argument("--cpus", help="usable CPUs, e.g. 0-15 (default: this process's affinity)")
    p.add_argument("--no-pin", action="store_true", help="pin nothing")
    p.add_argument("--streams", action="store_true",
                   help="also measure SSE events/s with long chat streams")
    p.add_argument("--stream-tokens", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=2)
    peers.add_arguments(p)
    p.add_argument("--out", type=Path, help="write settings, points and goals as JSON")
    p.add_argument("--markdown", type=Path, help="also write the tables to this file")
    p.add_argument("--log-dir", type=Path, help="process logs (default: a temporary dir)")
    p.add_argument("--timeout", type=float, default=540.0,
                   help="stop (reporting what was measured) after this many seconds")
    p.add_argument("--quick", action="store_true",
                   help="smoke-sized defaults: 0.5 s warm-up, 1.5 s windows, 16 connections")
    args = p.parse_args(argv)
    for name, full, quick in (("warmup", 1.0, 0.5), ("duration", 4.0, 1.5),
                              ("connections", 96, 16)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    args.workers = sorted(set(_ints(args.workers)))
    args.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = [t for t in args.targets if t not in TARGETS]
    if unknown:
        p.error(f"unknown targets {unknown}; choose from {list(TARGETS)}")
    args.cpus = _ints(args.cpus) if args.cpus else sorted(os.sched_getaffinity(0))
    return args


def warm(port: int, body: bytes, timeout: float = 30.0) -> None:
    """One request must succeed before anything is measured."""
    deadline = time.monotonic() + timeout
    while True:
        request = urllib.request.Request(f"http://{HOST}:{port}/generate", data=body,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                if response.status == 200:
                    return
                problem = f"status {response.status}"
        except (OSError, urllib.error.URLError) as exc:  # HTTPError (>= 400) is one
            problem = str(exc)
        if time.monotonic() > deadline:
            raise RuntimeError(f"no request through port {port} succeeded in {timeout:.0f}s: "
                               f"{problem}")
        time.sleep(0.2)


class Bench:
    """Measures each target at each N against one stub farm with one set of load processes."""

    def __init__(self, args: argparse.Namespace, layout: Layout, farm: Cluster, gen: LoadGen,
                 peer_python: Path | None, log_dir: Path) -> None:
        self.args, self.layout, self.farm, self.gen = args, layout, farm, gen
        self.peer_python, self.log_dir = peer_python, log_dir
        self.gen_body = {"text": PROMPT, "sampling_params": {
            "max_new_tokens": args.max_new_tokens, "temperature": 0}}
        self.stream_body = {"model": MODEL, "stream": True, "max_tokens": args.stream_tokens,
                            "messages": [{"role": "user", "content": STREAM_PROMPT}]}

    def measure(self, target: Scaled, n: int) -> Point:
        a, proxy = self.args, PROXIES[target.proxy]
        port = free_port()
        cpus = self.layout.proxy_cpus(n)
        argv = pinned(proxy.argv(self.farm, port, self.peer_python) + target.flags(n), cpus)
        cwd = ROOT if proxy.ours else self.log_dir  # peers must not import our packages
        with running(f"{target.name}-n{n}", argv, self.log_dir,
                     f"http://{HOST}:{port}{proxy.ready_path}", timeout=90, cwd=cwd,
                     env=target.env(n)) as proc:
            if target.all_ready and n > 1:
                proc.wait_output(target.all_ready, 60)
            warm(port, json.dumps(self.gen_body).encode())
            closed = self.gen.run(Phase("closed", port, "/generate", self.gen_body,
                                        a.connections, a.warmup, a.duration),
                                  proc.pid, self.farm.pids)
            streamed = None
            if a.streams:
                streamed = self.gen.run(Phase("streams", port, "/v1/chat/completions",
                                              self.stream_body, a.connections, 0.0,
                                              a.duration), proc.pid, self.farm.pids)
        return make_point(target.name, n, proc.pid, closed, streamed, self.layout.groups(n))


def run_all(args: argparse.Namespace, layout: Layout, targets: list[Scaled],
            peer_python: Path | None, log_dir: Path) -> tuple[list[Point], list[str]]:
    """Every N (smallest first), every target at it; a target that fails to start or serve
    is reported and skipped; stops at --timeout with what it has."""
    points: list[Point] = []
    failures: list[str] = []
    started = time.monotonic()
    try:
        with stub_farm(layout.stubs, log_dir) as farm, LoadGen(layout.loads) as gen:
            bench = Bench(args, layout, farm, gen, peer_python, log_dir)
            print(f"[{time.monotonic() - started:5.0f}s] {len(farm.pids)} stubs and "
                  f"{len(gen.pids)} load processes ready", flush=True)
            for n in args.workers:
                for target in (t for t in targets if t.only(n)):
                    try:
                        point = bench.measure(target, n)
                    except (OSError, RuntimeError) as exc:  # TimeoutError is an OSError
                        failures.append(f"{target.name} N={n}: {exc}")
                        print(f"[{time.monotonic() - started:5.0f}s] {target.name} N={n} "
                              f"FAILED: {exc}", flush=True)
                        continue
                    points.append(point)
                    print(f"[{time.monotonic() - started:5.0f}s] {target.name} N={n} "
                          f"(CPUs {point.cpus}): {point.rps:,.0f} req/s, errors "
                          f"{point.errors + point.stream_errors}, proxy "
                          f"{fmt(point.proxy_cores, 2)} cores, stubs "
                          f"{fmt(point.stub_cores, 2)}, load "
                          f"{fmt(point.loadgen_cores, 2)}"
                          + (f", {point.events_per_s:,.0f} events/s"
                             if point.events_per_s is not None else ""), flush=True)
    except (OutOfTime, LoadGenBroken) as exc:
        print(f"{exc}: reporting the {len(points)} points measured so far", file=sys.stderr)
        failures.append(str(exc))
    return points, failures


def report(args: argparse.Namespace, layout: Layout, points: list[Point],
           failures: list[str], command: str) -> str:
    r = scaling_report
    parts = [
        f"`{command}` ({layout.describe()}; CPUs {_span(args.cpus)}: {topology(args.cpus)}; "
        f"{len(layout.loads)} x {args.connections} connections, {args.warmup:g} s warm-up, "
        f"{args.duration:g} s measured)",
        r.throughput_table(points, args.streams),
        r.goals_table(points), r.ratios_table(points),
        "CPU use in cores (closed loop), and the busy share of each group's CPUs:\n\n"
        + r.cpu_table(points, len(layout.stubs), len(layout.loads))]
    notes = r.warnings(points) + [f"not measured: {line.splitlines()[0]}" for line in failures]
    if notes:
        parts.append("\n".join(f"* {line}" for line in notes))
    return "\n\n".join(parts)


def open_files() -> int:
    """Raise this process's open-file limit (inherited by everything it starts) to the hard
    limit: hundreds of keep-alive connections meet in the stubs and the proxy."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop_after(args.timeout)
    print(f"open-file limit: {open_files()}", flush=True)
    layout = plan(args.cpus, max(args.workers), args.stub_procs, args.load_procs,
                  pin=not args.no_pin)
    print(f"{layout.describe()}; CPUs {_span(args.cpus)}: {topology(args.cpus)}", flush=True)
    if layout.loads[0]:  # this process only waits: keep it off the proxy's CPUs
        os.sched_setaffinity(0, layout.groups(1)["loads"])
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pd-scaling-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"logs: {log_dir}", flush=True)

    targets = [TARGETS[name] for name in args.targets]
    peer_python = None
    if any(PROXIES[t.proxy].peer for t in targets):
        try:
            peer_python = peers.peer_python(args.peers_venv, args.peers_python)
        except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
            print(f"peers unavailable, skipping them: {exc}", file=sys.stderr)
            targets = [t for t in targets if not PROXIES[t.proxy].peer]

    points, failures = run_all(args, layout, targets, peer_python, log_dir)
    signal.alarm(0)
    command = "python -m loadtests.scaling " + " ".join(
        sys.argv[1:] if argv is None else argv)
    text = report(args, layout, points, failures, command.strip())
    print("\n" + text, flush=True)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    if args.out:
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        settings["layout"] = layout.describe()
        settings["topology"] = topology(args.cpus)
        args.out.write_text(json.dumps(scaling_report.as_json(points, settings), indent=2,
                                       default=str) + "\n")
    return 0 if points else 1


if __name__ == "__main__":
    sys.exit(main())
