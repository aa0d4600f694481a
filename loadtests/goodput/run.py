"""SLO goodput benchmark: attainment per rate, goodput, the capacity bound, and past capacity.

    python -m loadtests.goodput                      # full: 2 prefill + 2 decode, ~8 min
    python -m loadtests.goodput --quick              # CI-sized: seconds, fixed small rates
    python -m loadtests.goodput --targets gateway --fractions 0.5,1.0 --duration 10
    python -m loadtests.goodput --workload hot       # one dominant hot prompt, ~5 min

1. The capacity bound (`capacity.py`): the highest rate at which a discrete-event simulation
   of the same servers, placing every request with exact knowledge of every server, meets the
   objectives for >= 90% of the requests; beside it the decode ceiling (`ceiling.py`), the
   completions per second no placement sustains.
2. The sweep: every router (`--targets`) at every rate, each rate a fraction of the capacity
   bound (`--fractions`) unless `--rates` gives them; open-loop arrivals of the mixed
   workload (`workload.py`) with per-request objectives as headers, after an unmeasured
   warm-up of the same documents and prompts at a quarter of the rate (`--warmup` seconds;
   the DES replays it too); attainment, TTFT/ITL percentiles, refusals (`report.py`).
3. Refinement (`--refine N`): each router's crossing of 90% bisected N times, each step one
   more run of that router at the middle of the swept rates around its crossing, so that a
   coarse sweep does not decide a ratio by its interpolation (where attainment falls steeply
   the straight line between two swept rates misplaces the crossing).
4. Past capacity (run before the sweep, so that `--budget` never skips it): our gateway at
   `--overload` x the capacity bound; served within objective, refused early (with
   Retry-After), cut for waiting (its `/metrics`: `measure.py`), completed rate against its
   goodput.

Servers: `backends.sim` with the timing profile `--timing` (default the H200 Llama-3-8B
calibration) and a KV pool of `--kv-tokens` per server (a prefill's prefix cache is its pool).
Prints one table per phase; `--out` writes every figure as JSON (rewritten after each run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from backends.sim.timing import PROFILES
from loadtests import peers
from loadtests.goodput.capacity import capacity_rate
from loadtests.goodput.ceiling import decode_ceiling
from loadtests.goodput.measure import OURS, cut_for_waiting, measure
from loadtests.goodput.physics import Physics
from loadtests.goodput.report import (
    goodput,
    make_row,
    markdown,
    offered_at,
    side_by_side,
    summary,
    sweep_table,
)
from loadtests.goodput.workload import (
    HOT_CACHE_TOKENS,
    HOT_SHAPE,
    QUICK_SHAPE,
    MixShape,
    mixed_plan,
    warmup_plan,
)
from loadtests.routing.cluster import SimOptions, sim_cluster
from loadtests.routing.targets import KNOWN

PEERS = ("sglang-router:cache_aware", "sglang-router:round_robin")


@dataclass(frozen=True)
class Setup:
    prefills: int
    decodes: int
    kv_tokens: int
    shape: MixShape
    duration: float  # seconds of arrivals per (router, rate)
    fractions: tuple[float, ...]  # of the capacity bound
    rates: tuple[float, ...]  # explicit rates (req/s); when given, `fractions` is unused
    targets: tuple[str, ...]
    overload: float  # x the capacity bound; 0: no past-capacity run
    overload_rate: float  # explicit rate of the past-capacity run (0: overload x capacity)
    cache_tokens: int = 0  # prefix cache per prefill when smaller than the pool (0: the pool)
    warmup: float = 0.0  # seconds of the plan's warm-up before each measured run (0: none)


FULL = Setup(prefills=2, decodes=2, kv_tokens=131072, shape=MixShape(), duration=12.0,
             fractions=(0.25, 0.5, 0.75, 1.0), rates=(),
             targets=(OURS, *PEERS), overload=1.5, overload_rate=0.0, warmup=4.0)
# The CI machine cannot drive the small cluster near its capacity bound (hundreds of
# requests/s): fixed small rates, the structure and the invariants only.
# A dominant hot prompt: the same cluster and sweep, the hot workload and smaller caches; the
# summary adds completed requests and TTFT p90 against each peer at every rate.
HOT = replace(FULL, cache_tokens=HOT_CACHE_TOKENS, shape=HOT_SHAPE)
QUICK = Setup(prefills=2, decodes=1, kv_tokens=4096, shape=QUICK_SHAPE, duration=4.0,
              fractions=(), rates=(3.0, 8.0), targets=(OURS, "gateway:round_robin"),
              overload=1.5, overload_rate=12.0)


def _floats(text: str) -> tuple[float, ...]:
    values = tuple(float(v) for v in text.split(",") if v.strip())
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"positive numbers, comma-separated: {text!r}")
    return values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.goodput", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="CI-sized run (seconds)")
    parser.add_argument("--workload", choices=("mixed", "hot"), default="mixed",
                        help="mixed chat/docqa/short (default) or one dominant hot prompt "
                        "over partitionable documents")
    parser.add_argument("--targets", help=f"comma-separated: {OURS} (ours, defaults) or any "
                        "of loadtests.routing's targets (default: gateway, "
                        "sglang-router:cache_aware, sglang-router:round_robin)")
    parser.add_argument("--fractions", type=_floats, help="rates as fractions of the "
                        "capacity bound (default 0.25,0.5,0.75,1.0)")
    parser.add_argument("--rates", type=_floats, help="explicit rates, req/s (quick: 3,8)")
    parser.add_argument("--duration", type=float, help="seconds of arrivals per run "
                        "(default 12; quick 4)")
    parser.add_argument("--warmup", type=float, help="seconds of warm-up before each run, "
                        "at a quarter of its rate, not measured (default 4; quick 0; 0: cold caches)")
    parser.add_argument("--overload", type=float, help="past-capacity run at this multiple "
                        "of the capacity bound (default 1.5; 0: none)")
    parser.add_argument("--prefills", type=int, help="prefill servers (default 2)")
    parser.add_argument("--decodes", type=int, help="decode servers (default 2; quick 1)")
    parser.add_argument("--kv-tokens", type=int, help="KV pool per server, tokens (default "
                        "131072; quick 4096)")
    parser.add_argument("--timing", default=Physics.timing, choices=tuple(PROFILES),
                        help="the simulator's timing profile (backends/sim/timing.py)")
    parser.add_argument("--refine", type=int, default=0, help="bisect each router's "
                        "crossing of 90%% this many times after the sweep (default 0)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=40.0, help="seconds per request "
                        "(the longest answer that can still attain is 3 s + 499 x 60 ms: 33 s)")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds: no run starts "
                        "that could end past this (the device's 10-minute call); the skipped "
                        "runs are listed")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--markdown", type=Path, help="write the table and summary as Markdown")
    parser.add_argument("--log-dir", type=Path, help="process logs (default: a temporary dir)")
    peers.add_arguments(parser)
    return parser.parse_args(argv)


def build_setup(args: argparse.Namespace) -> Setup:
    setup = QUICK if args.quick else HOT if args.workload == "hot" else FULL
    for name in ("prefills", "decodes", "kv_tokens", "duration"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    changes = {k: v for k, v in (
        ("prefills", args.prefills), ("decodes", args.decodes), ("kv_tokens", args.kv_tokens),
        ("duration", args.duration), ("fractions", args.fractions),
        ("overload", args.overload), ("warmup", args.warmup)) if v is not None}
    if args.warmup is not None and args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    if args.rates:
        changes["rates"] = args.rates
    elif args.fractions:
        changes["rates"] = ()
    if args.overload is not None:
        changes["overload_rate"] = 0.0
    if args.targets:
        names = tuple(n.strip() for n in args.targets.split(",") if n.strip())
        known = [OURS, *(n for n in KNOWN if n != "oracle")]  # the oracle routes no chat plan
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            raise ValueError(f"unknown targets {unknown}; choose from {', '.join(known)}")
        changes["targets"] = names
    setup = replace(setup, **changes)
    if not setup.rates and not setup.fractions:
        raise ValueError("no rates: give --rates or --fractions")
    return setup


def _on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _write(path: Path | None, results: dict) -> None:
    if path is not None:
        path.write_text(json.dumps(results, indent=1, default=str))


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    try:
        setup = build_setup(args)
        physics = Physics(kv_tokens=setup.kv_tokens, cache_tokens=setup.cache_tokens,
                          timing=args.timing)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _on_sigterm)
    peer_python = (peers.peer_python(args.peers_venv, args.peers_python)
                   if any(t.startswith(("sglang-router", "mini-lb")) for t in setup.targets)
                   else None)
    results: dict = {
        "command": "python -m loadtests.goodput " + shlex.join(argv or sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "load_avg_start": os.getloadavg()},
        "setup": asdict(setup), "timing": asdict(physics.profile),
    }
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
          f"on {os.cpu_count()} CPUs; timing {physics.profile.name}", flush=True)
    capacity = _capacity(setup, physics, args.seed, results)
    rates = setup.rates or tuple(round(f * capacity, 2) for f in setup.fractions)
    with contextlib.ExitStack() as stack:
        log_dir = args.log_dir or Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="goodput-")))
        log_dir.mkdir(parents=True, exist_ok=True)
        with sim_cluster(sim_options(setup, physics), log_dir) as cluster:
            run = _Runner(setup, args, cluster, log_dir, peer_python, results, started)
            over = setup.overload_rate or setup.overload * capacity
            if over > 0 and OURS in setup.targets:  # first: the budget never skips it
                run.past_capacity(over)
            run.sweep(rates)
            run.refine(args.refine)
    run.finish(capacity)
    results["machine"]["load_avg_end"] = os.getloadavg()
    _write(args.out, results)
    return 0


def sim_options(setup: Setup, physics: Physics) -> SimOptions:
    """The simulated servers of `setup`, started with the physics the DES computes with."""
    return SimOptions(prefills=setup.prefills, decodes=setup.decodes,
                      cache_tokens=physics.prefix_cache_tokens, sim_flags=physics.sim_flags())


def _capacity(setup: Setup, physics: Physics, seed: int, results: dict) -> float:
    print(f"\n== capacity bound: DES of {setup.prefills} prefill + {setup.decodes} decode, "
          f"{setup.duration:g} s of arrivals after {setup.warmup:g} s of warm-up", flush=True)
    rate, tried = capacity_rate(setup.shape, setup.duration, seed, setup.prefills,
                                setup.decodes, physics, warmup=setup.warmup)
    results["capacity"] = {"rate": rate, "tried": [
        {"rate": r.rate, "attainment": r.attainment, "requests": r.requests,
         "refused": r.refused} for r in tried]}
    ceiling = decode_ceiling(setup.shape, rate, seed, setup.decodes, physics)
    results["capacity"]["decode_ceiling"] = ceiling
    print(f"capacity bound: {rate:.1f} req/s; decode ceiling (ceiling.py): no router "
          f"completes more than {ceiling:.1f} requests/s in a steady state", flush=True)
    return rate


class _Runner:
    """The sweep and the past-capacity run on one cluster, filling `results` as it goes."""

    def __init__(self, setup: Setup, args: argparse.Namespace, cluster, log_dir: Path,
                 peer_python: Path | None, results: dict, started: float) -> None:
        self.setup, self.args, self.cluster = setup, args, cluster
        self.log_dir, self.peer_python, self.results = log_dir, peer_python, results
        self.rows: list = []
        self.overload_row = None
        self.started = started  # --budget counts from the start of main
        results["sweep"] = []
        results["skipped"] = []

    def _fits(self, name: str, rate: float) -> bool:
        """Whether a run can end within --budget: its arrivals, then at most a request's
        timeout of draining, and ~10 s of settling and starting the router."""
        worst = (time.monotonic() - self.started + self.setup.warmup + self.setup.duration
                 + self.args.timeout + 10)
        if worst <= self.args.budget:
            return True
        print(f"   skipped {name} at {rate:.1f} req/s: could end past --budget "
              f"{self.args.budget:g} s", flush=True)
        self.results["skipped"].append({"target": name, "rate": rate})
        return False

    def _run(self, name: str, rate: float):
        """The run's row and raw figures, or None when the servers never came to rest after
        the run before (a router that left work behind): then it is listed as skipped."""
        setup, args = self.setup, self.args
        plan = mixed_plan(setup.shape, rate, setup.duration, args.seed)
        warm = warmup_plan(setup.shape, rate, setup.warmup, args.seed)
        try:
            got = measure(name, self.cluster, plan, args.timeout, self.log_dir,
                          self.peer_python, warm)
        except TimeoutError as exc:
            print(f"   skipped {name} at {rate:.1f} req/s: {exc}", flush=True)
            self.results["skipped"].append({"target": name, "rate": rate, "why": str(exc)})
            return None
        row = make_row(name, rate, got.pairs, plan.duration)
        print(f"   {name} at {rate:.1f} req/s: {row.sent} sent, attainment "
              f"{100 * row.attainment:.1f}%, refused {row.refused}, errors {row.errors}, "
              f"TTFT p90 {row.ttft_p90_ms:.0f} ms, ITL p90 {row.itl_p90_ms:.1f} ms; cores: "
              f"busiest server {got.busiest_server_cores:.2f}, router {got.proxy_cores:.2f}, "
              f"load {os.getloadavg()[0]:.2f}", flush=True)
        return row, got

    @staticmethod
    def _extra(got) -> dict:
        return {"argv": got.argv, "elapsed_s": got.elapsed, "gateway_metrics": got.metrics,
                "busiest_server_cores": got.busiest_server_cores,
                "proxy_cores": got.proxy_cores, "prefill_legs": got.prefill_legs}

    def sweep(self, rates: tuple[float, ...]) -> None:
        print(f"\n== sweep: {', '.join(f'{r:g}' for r in rates)} req/s, "
              f"{self.setup.duration:g} s each", flush=True)
        for rate in rates:  # every router at a rate before the next: a budget cut stays fair
            for name in self.setup.targets:
                done = self._run(name, rate) if self._fits(name, rate) else None
                if done is None:
                    continue
                self._keep(*done)
        self._table()

    def _keep(self, row, got, **more) -> None:
        """One run of the sweep or its refinement: a row, its figures in the JSON."""
        self.rows.append(row)
        self.results["sweep"].append({**row.to_dict(), **self._extra(got), **more})
        _write(self.args.out, self.results)

    def _table(self) -> None:
        """The rows by router, then rate, printed."""
        order = {name: i for i, name in enumerate(self.setup.targets)}
        self.rows.sort(key=lambda r: (order[r.target], r.rate))
        print(f"\n{sweep_table(self.rows)}", flush=True)

    def _points(self) -> dict[str, list[tuple[float, float]]]:
        """(rate, attainment) per router, the past-capacity run included for ours."""
        points: dict[str, list[tuple[float, float]]] = {}
        for row in self.rows:
            points.setdefault(row.target, []).append((row.rate, row.attainment))
        if self.overload_row is not None and OURS in points:
            points[OURS].append((self.overload_row.rate, self.overload_row.attainment))
        return points

    def refine(self, steps: int) -> None:
        """Bisect each router's crossing `steps` times: one more run per step, at the middle
        of the rates around it (none for a router that attained at every rate)."""
        if steps <= 0:
            return
        print(f"\n== refine: each crossing bisected {steps} times", flush=True)
        for name in self.setup.targets:
            for _ in range(steps):
                found = goodput(self._points().get(name, []))
                if found.bracket is None:
                    break
                rate = round(sum(found.bracket) / 2, 2)
                done = self._run(name, rate) if self._fits(name, rate) else None
                if done is None:
                    break
                self._keep(*done, refined=True)
        self._table()

    def past_capacity(self, rate: float) -> None:
        print(f"\n== past capacity: {OURS} at {rate:.1f} req/s", flush=True)
        done = self._run(OURS, rate) if self._fits(OURS, rate) else None
        if done is None:
            return
        row, got = done
        self.overload_row = row
        self.results["past_capacity"] = {
            **row.to_dict(), **self._extra(got),
            "cut_for_waiting": cut_for_waiting(got.metrics),
            "metrics_read": "gateway /metrics before and after: deltas of "
                            "gateway_retries_total (reason timeout|rescued: cut for waiting), "
                            "gateway_requests_total (status 504), "
                            "gateway_admission_rejections_total, gateway_slo_requests_total, "
                            "gateway_upstream_failures_total, gateway_stream_failovers_total"}
        _write(self.args.out, self.results)

    def finish(self, capacity: float) -> None:
        """Goodput per router, the ratios, the past-capacity verdicts; printed and stored."""
        goodputs = {name: goodput(p) for name, p in self._points().items()}
        others = tuple(t for t in self.setup.targets if t != OURS)
        lines = summary(goodputs, capacity, OURS, others) + side_by_side(self.rows, OURS, others)
        self.results["goodput"] = {n: {"rate": g.rate, "lower_bound": g.lower_bound,
                                       "bracket": g.bracket} for n, g in goodputs.items()}
        over = self.results.get("past_capacity")
        if over is not None:
            mine = goodputs.get(OURS)
            ours = [r for r in self.rows if r.target == OURS] + [self.overload_row]
            offered = offered_at(ours, mine.rate) if mine and mine.rate else 0.0
            ratio = over["completed_per_s"] / offered if offered else 0.0
            over["goodput_offered_per_s"] = offered
            over["completed_over_goodput"] = ratio
            lines.append(
                f"past capacity ({over['rate']:.1f} req/s, {over['offered_per_s']:.1f} "
                f"offered): {over['completed_per_s']:.1f} completed/s ({ratio:.2f}x goodput, "
                f"whose plans offer {offered:.1f} req/s), {over['attained']} of {over['sent']} "
                f"within objective, {over['refused']} refused early "
                f"({over['refused_retry_after']} with Retry-After), {over['errors']} other "
                f"failures, {over['cut_for_waiting']} cut for waiting; prefill legs "
                f"{over['prefill_legs']} for {over['sent'] - over['refused']} not refused")
        self.results["summary"] = lines
        print("\n" + "\n".join(lines), flush=True)
        if self.args.markdown is not None:
            self.args.markdown.write_text(markdown(self.rows, lines))
