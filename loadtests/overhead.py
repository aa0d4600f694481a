"""Gateway overhead, side by side: our gateway, sglang-router 0.3.2 (Rust) and mini_lb.

    python -m loadtests.overhead                # full run (about 15 minutes), Markdown tables
    python -m loadtests.overhead --quick        # one short round (about 2 minutes)
    python -m loadtests.overhead --quick --targets gateway-own,gateway-aiohttp,gateway-httpx
                                                # the three data-path clients side by side

One run starts the PD servers once (`--backend stub`: a zero-cost PD pair that enforces room
pairing; `--backend sim`: the SGLang simulator with `--fast`), then measures each target in
turn, round after round, on the same CPU layout: the proxy on `--proxy-cpu` (core 0), the
servers and this load generator on `--load-cpu` (core 1). The floor is no proxy at all: the
load generator sends both PD legs itself, with a fresh bootstrap room, as a zero-cost proxy
would.

Per target and round:
  closed loop   64 connections, small non-streaming /generate (max_new_tokens 2): requests/s,
                and the proxy's CPU-seconds (utime+stime of it and its children) per 1000
  open loop     fixed rates on a precomputed schedule, latency from the scheduled send time
                (no coordinated omission): p50 / p99, and p99 minus the floor's ("added")
  streams       64 concurrent chat streams of 256 tokens: SSE events/s through the proxy
  memory        the proxy's peak RSS (VmHWM of it and its children)
Figures are medians over `--rounds`. The load generator is this process: raw asyncio + uvloop
HTTP/1.1 keep-alive connections parsed with httptools (`loadtests/client.py`).
See docs/BENCHMARKS.md for the method and the latest results.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loadtests import loads, peers, profile
from loadtests.client import ReplyError
from loadtests.cluster import BACKENDS, Cluster, cluster
from loadtests.launch import HOST, ROOT, OutOfTime, free_port, pinned, running, stop_after
from loadtests.procstat import WindowMeter, peak_rss_mb, wait_quiet
from loadtests.report import (
    Run,
    as_json,
    clients_table,
    goals_table,
    noise_table,
    ratios_table,
    results_table,
    summarize,
)
from loadtests.routes import BothLegs, ViaProxy
from loadtests.targets import TARGETS, Target

PROMPT = "Summarise the plot of a short story about a lighthouse keeper and a storm."
STREAM_PROMPT = "Tell me a long story about a lighthouse keeper."
MODEL = {"stub": "stub-model", "sim": "sim-model"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtests.overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", default=",".join(TARGETS),
                   help=f"comma-separated, from {', '.join(TARGETS)} (default: all)")
    p.add_argument("--backend", choices=BACKENDS, default="stub",
                   help="PD servers behind the proxies (default: stub)")
    p.add_argument("--decodes", type=int, default=2, help="decode servers (default: 2)")
    p.add_argument("--rounds", type=int, default=3, help="repeats; medians are reported")
    p.add_argument("--duration", type=float, default=5.0,
                   help="seconds of the closed loop (streams and open loop take 4/5 of it)")
    p.add_argument("--rates", help="open-loop rates in requests/s, comma-separated "
                                   "(default: 500,1000; --quick: 200,500)")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=2)
    p.add_argument("--stream-tokens", type=int, default=256)
    p.add_argument("--proxy-cpu", type=int, default=0)
    p.add_argument("--load-cpu", type=int, default=1)
    p.add_argument("--server-cpu", type=int,
                   help="the PD servers' own CPU (default: --load-cpu's); where cores allow, "
                        "so that servers and load generator are never the bottleneck")
    p.add_argument("--no-pin", action="store_true", help="do not pin anything to a CPU")
    peers.add_arguments(p)
    p.add_argument("--out", type=Path, help="write settings, medians and every run as JSON")
    p.add_argument("--markdown", type=Path, help="also write the tables to this file")
    p.add_argument("--profile", type=Path, metavar="DIR",
                   help="afterwards, profile each Python proxy under the closed loop with "
                        "py-spy (collapsed stacks + a summary in DIR)")
    p.add_argument("--quiet-wait", type=float, default=60.0,
                   help="before each target, wait up to this many seconds for other work on "
                        "the machine to calm down (0: do not wait)")
    p.add_argument("--max-noise", type=float, default=0.3,
                   help="cores that other work may use: more before a target means waiting, "
                        "more while it is measured means measuring it again")
    p.add_argument("--retries", type=int, default=2,
                   help="extra attempts of a noisy measurement; the least noisy is kept")
    p.add_argument("--log-dir", type=Path, help="process logs (default: a temporary dir)")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="give up (and clean up) after this many seconds")
    p.add_argument("--quick", action="store_true",
                   help="CI-sized: 1 round, 2 s phases, rates 200,500, no noise waits")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.duration, args.quiet_wait, args.retries = 1, 2.0, 0.0, 0
    args.rates = args.rates or ("200,500" if args.quick else "500,1000")
    args.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = [t for t in args.targets if t not in TARGETS]
    if unknown:
        p.error(f"unknown targets {unknown}; choose from {list(TARGETS)}")
    args.rates = [float(r) for r in args.rates.split(",") if r.strip()]
    if args.no_pin or (os.cpu_count() or 1) < 2:
        args.proxy_cpu = args.load_cpu = args.server_cpu = None
    elif args.server_cpu is None:
        args.server_cpu = args.load_cpu
    return args


class Bench:
    """Measures targets against one cluster, with one event loop for the load generator."""

    def __init__(self, args: argparse.Namespace, c: Cluster, log_dir: Path,
                 peer_python: Path | None, runner: asyncio.Runner) -> None:
        self.args = args
        self.cluster = c
        self.log_dir = log_dir
        self.peer_python = peer_python
        self.runner = runner
        model = MODEL[c.backend]
        self.gen_body = {"text": PROMPT, "sampling_params": {
            "max_new_tokens": args.max_new_tokens, "temperature": 0}}
        self.stream_body = {"model": model, "stream": True, "max_tokens": args.stream_tokens,
                            "messages": [{"role": "user", "content": STREAM_PROMPT}]}

    def routes(self, port: int | None) -> tuple[object, object]:
        if port is None:
            c = self.cluster
            return (BothLegs(c.prefill_port, c.bootstrap_port, c.decode_ports, "/generate",
                             self.gen_body),
                    BothLegs(c.prefill_port, c.bootstrap_port, c.decode_ports,
                             "/v1/chat/completions", self.stream_body))
        return (ViaProxy(port, "/generate", self.gen_body),
                ViaProxy(port, "/v1/chat/completions", self.stream_body))

    @contextlib.contextmanager
    def started(self, target: Target, label: str):
        """The target's proxy process (None for the floor) and its port, ready to serve."""
        if target.argv is None:
            yield None, None
            return
        port = free_port()
        with contextlib.ExitStack() as stack:
            extra = stack.enter_context(target.sidecar(self.log_dir, self.args.load_cpu)) \
                if target.sidecar is not None else []
            argv = pinned(target.argv(self.cluster, port, self.peer_python) + extra,
                          self.args.proxy_cpu)
            cwd = ROOT if target.ours else self.log_dir  # peers must not import our packages
            proc = stack.enter_context(running(
                label, argv, self.log_dir, f"http://{HOST}:{port}{target.ready_path}",
                timeout=90, cwd=cwd))
            yield proc, port

    def warm(self, route) -> None:
        """One request must succeed (within 30 s) before anything is measured."""
        async def first() -> None:
            session = route.session()
            deadline = time.monotonic() + 30
            try:
                while True:
                    try:
                        await session.call()
                        return
                    except ReplyError:
                        if time.monotonic() > deadline:
                            raise
                        await asyncio.sleep(0.2)
            finally:
                session.close()
        self.runner.run(first())

    def measure(self, target: Target, round_no: int) -> Run:
        a = self.args
        with self.started(target, f"{target.name}-r{round_no}") as (proc, port):
            gen, stream = self.routes(port)
            self.warm(gen)
            if a.quiet_wait > 0:
                busy = wait_quiet(a.max_noise, a.quiet_wait)
                if busy > a.max_noise:
                    print(f"  note: the machine is busy with other work ({busy:.2f} cores) "
                          f"before {target.name}; measuring anyway", flush=True)
            meter = WindowMeter(proc.pid if proc else None, self.cluster.pids)
            whole = WindowMeter(proc.pid if proc else None, self.cluster.pids)
            whole.start()
            t0 = time.perf_counter()
            closed = self.runner.run(loads.closed_loop(gen, a.concurrency, 1.0, a.duration,
                                                       meter))
            opened = [self.runner.run(loads.open_loop(gen, rate, a.duration * 0.8))
                      for rate in a.rates]
            streamed = self.runner.run(loads.streams(stream, a.concurrency, a.duration * 0.8,
                                                     meter))
            alone = self.runner.run(loads.streams(stream, 1, max(0.5, a.duration * 0.2)))
            noise = whole.stop().other / (time.perf_counter() - t0)
            rss = peak_rss_mb(proc.pid) if proc else None
        usage, s_usage = closed.cpu, streamed.cpu
        return Run(
            target=target.name, round=round_no, rps=closed.rps, errors=closed.errors,
            cpu_per_1k=usage.proxy / closed.requests * 1000 if proc and closed.requests
            else None,
            proxy_busy=usage.proxy / closed.seconds if proc else None,
            backend_busy=usage.backends / closed.seconds,
            loadgen_busy=usage.loadgen / closed.seconds, other_busy=noise,
            open_loop={f"{o.rate:g}": {"p50_ms": o.p50_ms, "p99_ms": o.p99_ms,
                                       "errors": o.errors} for o in opened},
            events_per_s=streamed.events_per_s, stream_errors=streamed.errors,
            stream_first_event_ms=streamed.first_event_p50_ms,
            alone_first_event_ms=alone.first_event_p50_ms,
            stream_cpu_per_1k_events=s_usage.proxy / streamed.events * 1000
            if proc and streamed.events else None,
            stream_proxy_busy=s_usage.proxy / streamed.seconds if proc else None,
            rss_mb=rss,
            cores={c: busy / closed.seconds for c, busy in usage.cores.items()},
            stream_cores={c: busy / streamed.seconds for c, busy in s_usage.cores.items()})

    def profile(self, target: Target, out_dir: Path) -> str:
        """py-spy on the proxy during a closed loop, then during concurrent streams; returns
        the summaries of both."""
        out_dir.mkdir(parents=True, exist_ok=True)
        seconds = max(5, int(self.args.duration * 2))
        texts = []
        with self.started(target, f"{target.name}-profile") as (proc, port):
            gen, stream = self.routes(port)
            self.warm(gen)
            for phase, load in (
                    ("", lambda: loads.closed_loop(gen, self.args.concurrency, 0.5,
                                                   seconds + 1.0)),
                    ("-streams", lambda: loads.streams(stream, self.args.concurrency,
                                                       seconds + 1.0))):
                raw = out_dir / f"{target.name}{phase}.collapsed.txt"
                spy = subprocess.Popen(
                    ["py-spy", "record", "--pid", str(proc.pid), "--duration", str(seconds),
                     "--rate", "200", "--function", "--format", "raw", "--output", str(raw)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    start_new_session=True)
                try:
                    self.runner.run(load())
                    spy.wait(30)
                finally:
                    if spy.poll() is None:
                        os.killpg(spy.pid, signal.SIGKILL)
                        spy.wait(5)
                text = profile.summary(raw, top=25)
                (out_dir / f"{target.name}{phase}.summary.txt").write_text(text + "\n")
                texts.append(text)
        return "\n\n".join(texts)


def measure_quietly(bench: Bench, target: Target, round_no: int, give_up_at: float) -> Run:
    """Measure; again (up to --retries) when other work disturbed it. Keeps the calmest."""
    args = bench.args
    attempts = [bench.measure(target, round_no)]
    while (attempts[-1].other_busy > args.max_noise and len(attempts) <= args.retries
           and time.monotonic() < give_up_at):
        print(f"  {target.name}: other work used {attempts[-1].other_busy:.2f} cores while "
              f"it was measured; measuring again", flush=True)
        attempts.append(bench.measure(target, round_no))
    best = min(attempts, key=lambda run: run.other_busy)
    best.attempts = len(attempts)
    return best


def run_all(args: argparse.Namespace, targets: list[Target], peer_python: Path | None,
            log_dir: Path) -> tuple[list[Run], dict[str, str]]:
    """Every round of every target, then the profiles; stops early (keeping what it has)
    when --timeout is reached."""
    runs: list[Run] = []
    profiles: dict[str, str] = {}
    try:
        import uvloop
        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    started = time.monotonic()
    give_up_retrying = started + args.timeout * 0.6
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner, \
                cluster(args.backend, args.decodes, args.server_cpu, log_dir) as c:
            bench = Bench(args, c, log_dir, peer_python, runner)
            for round_no in range(1, args.rounds + 1):
                for target in targets:
                    run = measure_quietly(bench, target, round_no, give_up_retrying)
                    runs.append(run)
                    print(f"[{time.monotonic() - started:6.0f}s] round {round_no} "
                          f"{target.name}: {run.rps:,.0f} req/s, {run.events_per_s:,.0f} "
                          f"events/s, errors {run.errors + run.stream_errors}, other work "
                          f"{run.other_busy:.2f} cores", flush=True)
            if args.profile:
                if shutil.which("py-spy") is None:
                    print("--profile needs py-spy: pip install py-spy", file=sys.stderr)
                for target in targets:
                    if target.argv is not None and (target.ours or target.name == "mini-lb"):
                        profiles[target.name] = bench.profile(target, args.profile)
    except OutOfTime as exc:
        print(f"{exc}: reporting the {len(runs)} runs measured so far", file=sys.stderr)
    return runs, profiles


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop_after(args.timeout)
    if args.load_cpu is not None:
        os.sched_setaffinity(0, {args.load_cpu})
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pd-overhead-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"logs: {log_dir}", flush=True)

    targets = [TARGETS[name] for name in args.targets]
    peer_python = None
    if any(t.peer for t in targets):
        try:
            peer_python = peers.peer_python(args.peers_venv, args.peers_python)
        except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
            print(f"peers unavailable, skipping them: {exc}", file=sys.stderr)
            targets = [t for t in targets if not t.peer]

    runs, profiles = run_all(args, targets, peer_python, log_dir)
    signal.alarm(0)

    summary = summarize(runs)
    command = "python -m loadtests.overhead " + " ".join(argv if argv is not None
                                                         else sys.argv[1:])
    text = "\n\n".join([
        f"`{command.strip()}` (backend {args.backend}, 1 prefill + {args.decodes} decode, "
        f"{args.rounds} rounds, medians; proxy on CPU {args.proxy_cpu}, servers on CPU "
        f"{args.server_cpu}, load generator on CPU {args.load_cpu})",
        results_table(summary),
        "Data-path clients (our gateway with each `--upstream-client`), relative to the own "
        "client:\n\n" + clients_table(summary, runs),
        ratios_table(summary), goals_table(summary),
        "CPU use in cores (proxy, servers, load generator: closed loop; other processes: "
        "the whole measurement), and each core's busy share:\n\n"
        + noise_table(summary)])
    print("\n" + text)
    for name, summary_text in profiles.items():
        print(f"\n## profile: {name}\n{summary_text}")
    if args.markdown:
        args.markdown.write_text(text + "\n")
    if args.out:
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        args.out.write_text(json.dumps(as_json(runs, summary, settings), indent=2,
                                       default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
