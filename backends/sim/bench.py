"""PD throughput of the sim: `python -m backends.sim.bench --pairs 64 --duration 5`.

Starts one prefill and one decode sim (`--fast`), pins both and this process
(the load generator) to one core with `taskset`, and drives `--pairs`
concurrent PD pairs closed-loop over keep-alive connections
(`backends.sim.loadgen`). It reports pairs/s, pair latency p50/p99, and the
CPU each process used in the window: if the core is near 100% busy the cost
per pair is what limits, if it is idle something waits.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from backends.launcher.ports import free_port
from backends.sim.loadgen import PairSpec, Results, rooms, worker

HOST = "127.0.0.1"
ROOT = Path(__file__).resolve().parents[2]
PROMPT = "The quick brown fox jumps over the lazy dog"
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (from /proc, any process)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


@dataclass
class SimProcess:
    name: str
    popen: subprocess.Popen[bytes]
    port: int
    log: Path

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(5)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        self.log.unlink(missing_ok=True)


def start_sim(mode: str, port: int, cpu: int | None, extra: list[str],
              bootstrap_port: int | None = None) -> SimProcess:
    argv = [sys.executable, "-m", "backends.sim", "--mode", mode, "--host", HOST,
            "--port", str(port), "--fast", *extra]
    if bootstrap_port is not None:
        argv += ["--bootstrap-port", str(bootstrap_port)]
    if cpu is not None:
        argv = ["taskset", "-c", str(cpu), *argv]
    log = Path(tempfile.mkstemp(prefix=f"bench-{mode}-", suffix=".log")[1])
    with log.open("wb") as out:
        popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    return SimProcess(mode, popen, port, log)


def wait_ready(sim: SimProcess, timeout: float = 20.0) -> None:
    """Until GET /health answers 200 (plain socket: no proxy settings apply)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sim.popen.poll() is not None:
            raise RuntimeError(f"{sim.name} sim exited:\n{sim.log.read_text(errors='replace')}")
        try:
            with socket.create_connection((HOST, sim.port), timeout=1.0) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                if s.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{sim.name} sim not ready after {timeout}s")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def core_jiffies(cpu: int | None) -> tuple[int, int]:
    """(idle, total) jiffies of one core (all cores when not pinned), from /proc/stat."""
    name = f"cpu{cpu} " if cpu is not None else "cpu "
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith(name):
            values = [int(v) for v in line.split()[1:]]
            return values[3] + values[4], sum(values)
    return 0, 0


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


async def drive(spec: PairSpec, pairs: int, warmup: float, duration: float,
                pids: dict[str, int], cpu: int | None) -> dict[str, Any]:
    """Run the workers; measure throughput, latency and CPU over the window."""
    results = Results()
    room_ids = rooms()
    tasks = [asyncio.create_task(worker(spec, results, room_ids)) for _ in range(pairs)]
    await asyncio.sleep(warmup)
    for task in tasks:
        if task.done():
            task.result()  # a worker that could not connect: raise its error
    cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
    idle0, total0 = core_jiffies(cpu)
    wall0 = time.perf_counter()
    results.recording = True
    await asyncio.sleep(duration)
    results.recording = False
    wall = time.perf_counter() - wall0
    idle1, total1 = core_jiffies(cpu)
    used = {name: cpu_seconds(pid) - cpu0[name] for name, pid in pids.items()}
    core_idle = (idle1 - idle0) / max(1, total1 - total0)
    rss = {name: round(rss_mb(pid), 1) for name, pid in pids.items() if name != "loadgen"}
    results.stopping = True
    await asyncio.gather(*tasks)
    lat = sorted(results.latencies)
    done = len(lat)
    return {
        "pairs": pairs, "window_s": round(wall, 3), "completed": done,
        "pairs_per_s": round(done / wall, 1),
        "latency_ms": {"p50": round(percentile(lat, 0.50) * 1e3, 3),
                       "p99": round(percentile(lat, 0.99) * 1e3, 3),
                       "max": round((lat[-1] if lat else float("nan")) * 1e3, 3)},
        "cpu_s": {k: round(v, 3) for k, v in used.items()},
        "cpu_us_per_pair": {k: round(v / done * 1e6, 1) if done else None for k, v in used.items()},
        "core_busy": round(sum(used.values()) / wall, 3),
        "core_idle": round(core_idle, 3) if cpu is not None else None,
        "capacity_pairs_per_s": round(done / sum(used.values()), 1) if done else None,
        "rss_mb": rss,
        "errors": results.errors, "error_samples": results.error_samples,
        "checked_pairs": results.checked,
    }


def report(result: dict[str, Any], cpu: int | None) -> str:
    lat, cpu_s, per = result["latency_ms"], result["cpu_s"], result["cpu_us_per_pair"]
    where = f"all on core {cpu}" if cpu is not None else "not pinned"
    lines = [
        f"{result['pairs']} concurrent PD pairs, {result['window_s']} s window ({where})",
        f"  throughput  {result['pairs_per_s']:.0f} pairs/s ({result['completed']} pairs)",
        f"  latency     p50 {lat['p50']:.2f} ms   p99 {lat['p99']:.2f} ms   max {lat['max']:.2f} ms",
        "  cpu         " + "   ".join(f"{k} {cpu_s[k]:.2f} s ({per[k]} us/pair)" for k in cpu_s),
        f"  core busy   {result['core_busy'] * 100:.0f}% of one core by the three processes"
        + (f", {result['core_idle'] * 100:.0f}% idle (the rest: other processes)"
           if result["core_idle"] is not None else ""),
        f"  capacity    {result['capacity_pairs_per_s'] or 0:.0f} pairs/s if the three had the core"
        " to themselves (pairs / their CPU seconds)",
        "  memory      " + "   ".join(f"{k} {v:.0f} MB RSS" for k, v in result["rss_mb"].items()),
        f"  errors      {result['errors']} ({result['checked_pairs']} pairs fully checked)",
    ]
    lines += [f"    {s}" for s in result["error_samples"]]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m backends.sim.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=64, help="concurrent PD pairs")
    parser.add_argument("--duration", type=float, default=5.0, help="measuring window, seconds")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds before the window")
    parser.add_argument("--cpu", default="1",
                        help="core for the sims and the load generator; 'none' to not pin")
    parser.add_argument("--max-new-tokens", type=int, default=2)
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--sim-arg", action="append", default=[],
                        help="extra flag for both sims (repeat; e.g. --sim-arg=--page-size=16)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cpu = None if args.cpu == "none" else int(args.cpu)
    if cpu is not None and cpu not in os.sched_getaffinity(0):
        parser.error(f"--cpu {cpu}: not one of this machine's cores "
                     f"{sorted(os.sched_getaffinity(0))} (or 'none')")
    ports = {"prefill": free_port(), "bootstrap": free_port(), "decode": free_port()}
    sims = [start_sim("prefill", ports["prefill"], cpu, args.sim_arg, ports["bootstrap"]),
            start_sim("decode", ports["decode"], cpu, args.sim_arg)]
    try:
        for sim in sims:
            wait_ready(sim)
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})
        spec = PairSpec(HOST, ports["prefill"], ports["decode"], ports["bootstrap"],
                        args.prompt, args.max_new_tokens)
        pids = {"prefill": sims[0].popen.pid, "decode": sims[1].popen.pid, "loadgen": os.getpid()}
        try:
            import uvloop
            runner = uvloop.run
        except ImportError:  # pragma: no cover - uvicorn[standard] brings uvloop
            runner = asyncio.run
        result = runner(drive(spec, args.pairs, args.warmup, args.duration, pids, cpu))
    finally:
        for sim in sims:
            sim.stop()
    print(orjson.dumps(result).decode() if args.json else report(result, cpu))
    return 1 if result["errors"] or not result["completed"] else 0


if __name__ == "__main__":
    sys.exit(main())
