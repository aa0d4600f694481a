"""Shifting-workload benchmark: automatic rebalancing against every static split.

    python -m loadtests.rebalance            # 4 servers, 3 phases, 4 runs: ~7 min on 2 cores
    python -m loadtests.rebalance --quick    # 3 servers, short phases, 2 runs (the CI test)

Each run starts fresh simulated servers (`backends.sim --enable-pd-role-switch`, every one
with its own bootstrap port, the timing slowed so that a 2-core machine can press a role:
`SIM_FLAGS`) and a gateway, replays the same open-loop Poisson plan (workload.py) through it,
and reads the gateway's rebalancing decisions and the final roles. The runs: `--rebalance`
from the starting split, then every static split (1 prefill to n-1, and so on). Goodput is
the requests that met both objectives per second of arrivals; a request lost is one whose
answer was not a complete 200 stream (the bar is 0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from loadtests.goodput.client import send
from loadtests.launch import running
from loadtests.rebalance.report import Result, summary, table
from loadtests.rebalance.workload import Phase, Request, attained, plan
from loadtests.routing.cluster import SimServer, free_ports
from loadtests.routing.workloads import CHAT_PATH

HOST = "127.0.0.1"
# the H200 calibration's shape (docs/SIMULATOR.md), slowed: decode 40 ms a step + 1 ms a
# request, 10 at most (50 ms at a full batch, under the 60 ms objective: a full decode queues
# requests, which the TTFT then shows); prefill 0.12 ms a token (a 4,000-token prompt takes
# about half a second)
SIM_FLAGS = ("--log-level", "warning", "--enable-pd-role-switch", "--timing", "h200-llama3-8b",
             "--decode-step-ms", "40", "--decode-ms-per-req", "1", "--decode-ms-per-kv-token", "0",
             "--max-running-requests", "10", "--prefill-ms-per-token", "0.12",
             "--bootstrap-timeout", "10", "--waiting-timeout", "10")
REBALANCE = ("--rebalance", "--rebalance-window", "2", "--rebalance-cooldown", "6",
             "--rebalance-max-per-hour", "60")
GATEWAY_FLAGS = ("--log-level", "warning", "--loads-interval", "0.5", "--health-interval", "1")


@dataclass(frozen=True)
class Setup:
    servers: int
    start_prefills: int  # the split it starts with
    phases: tuple[Phase, ...]
    statics: tuple[int, ...]  # prefill counts of the static runs

    def split(self, prefills: int) -> str:
        return f"{prefills}P:{self.servers - prefills}D"


LONG_OUT, LONG_IN = (200, 60), (4000, 8)  # (prompt, output) tokens
FULL = Setup(4, 2, (Phase("long outputs", 25, 8.0, *LONG_OUT),
                    Phase("long prompts", 35, 3.2, *LONG_IN),
                    Phase("long outputs again", 25, 8.0, *LONG_OUT)), (1, 2, 3))
QUICK = Setup(3, 1, (Phase("long outputs", 6, 4.0, *LONG_OUT),
                     Phase("long prompts", 14, 3.0, *LONG_IN),
                     Phase("long outputs again", 12, 5.5, *LONG_OUT)), (1,))


def start_servers(setup: Setup, prefills: int, log_dir: Path, stack) -> list[SimServer]:
    taken: set[int] = set()
    servers = [SimServer("prefill" if i < prefills else "decode", free_ports(1, taken),
                         free_ports(1, taken)) for i in range(setup.servers)]
    procs = [stack.enter_context(running(f"sim-{i}", s.argv(*SIM_FLAGS), log_dir, None))
             for i, s in enumerate(servers)]
    for server, proc in zip(servers, procs, strict=True):
        proc.wait_ready(server.url + "/health", 60.0)
    return servers


def start_gateway(servers: list[SimServer], flags: tuple[str, ...], log_dir: Path,
                  stack) -> int:
    port = free_ports(1, set())
    argv = [sys.executable, "-m", "gateway", "--host", HOST, "--port", str(port),
            *GATEWAY_FLAGS, *flags]
    for s in servers:
        argv += (["--prefill", s.url, str(s.bootstrap_port)] if s.role == "prefill"
                 else ["--decode", s.url])
    stack.enter_context(running("gateway", argv, log_dir, f"http://{HOST}:{port}/readiness"))
    return port


async def _one(port: int, request: Request, start: float, out: list) -> None:
    delay = start + request.at - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    out.append((request, await send(port, CHAT_PATH, request.body, {}, 120.0)))


async def replay(port: int, requests: list[Request]) -> list:
    out: list = []
    start = time.perf_counter() + 0.1
    await asyncio.gather(*(_one(port, r, start, out) for r in requests))
    return out


def decisions(port: int) -> tuple[dict[str, float], dict[str, int]]:
    """The rebalancing decisions ("from>to:reason:outcome" -> count) and the final roles."""
    base = f"http://{HOST}:{port}"
    counts: dict[str, float] = {}
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith("gateway_rebalance_decisions_total{"):
            labels = dict(part.split("=", 1) for part in
                          line[line.index("{") + 1:line.index("}")].replace('"', "").split(","))
            key = f"{labels['from']}>{labels['to']}:{labels['reason']}:{labels['outcome']}"
            counts[key] = float(line.rsplit(" ", 1)[1])
    roles = {"prefill": 0, "decode": 0}
    for snap in httpx.get(base + "/admin/servers", timeout=10).json()["servers"]:
        if snap["healthy"] and not snap["draining"]:
            roles[snap["role"]] += 1
    return counts, roles


def one_run(setup: Setup, name: str, prefills: int, flags: tuple[str, ...],
            requests: list[Request], log_dir: Path) -> Result:
    import contextlib  # noqa: PLC0415 - ExitStack only here

    (log_dir / name).mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        servers = start_servers(setup, prefills, log_dir / name, stack)
        port = start_gateway(servers, flags, log_dir / name, stack)
        pairs = asyncio.run(replay(port, requests))
        switched, roles = decisions(port)
    by_phase: dict[str, list[int]] = {p.name: [0, 0] for p in setup.phases}
    lost = 0
    for request, outcome in pairs:
        by_phase[request.phase][0] += 1
        complete = outcome.ok and outcome.status == 200
        lost += not complete
        by_phase[request.phase][1] += complete and attained(outcome.ttft, outcome.itl)
    seconds = sum(p.duration for p in setup.phases)
    return Result(name, setup.split(prefills), by_phase, lost, seconds, switched,
                  f"{roles['prefill']}P:{roles['decode']}D")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.rebalance")
    parser.add_argument("--quick", action="store_true", help="CI-sized: 3 servers, 2 runs")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=Path, help="write every figure as JSON here")
    parser.add_argument("--log-dir", type=Path, help="process logs (default: a temp dir)")
    args = parser.parse_args(argv)
    setup = QUICK if args.quick else FULL
    requests = plan(setup.phases, args.seed)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="rebalance-"))
    runs = [("rebalance", setup.start_prefills, REBALANCE)]
    runs += [(f"static {setup.split(p)}", p, ()) for p in setup.statics]
    results = []
    for name, prefills, flags in runs:
        started = time.monotonic()
        results.append(one_run(setup, name.replace(" ", "-").replace(":", ""), prefills,
                               flags, requests, log_dir))
        results[-1].name = name
        print(f"{name}: done in {time.monotonic() - started:.0f}s", file=sys.stderr,
              flush=True)
    print(table(results, setup.phases))
    print(summary(results, setup.split(setup.start_prefills)))
    if args.out is not None:
        args.out.write_text(json.dumps([r.as_dict() for r in results], indent=2))
    return 0
