"""Figures of one proxy at N cores, and the tables of `loadtests.scaling`.

Scaling efficiency is req/s(N) / (N x req/s(1)), each target against its own N = 1 (our
`gateway-reuseport` against `gateway`'s: at one worker they are the same process). The CPU
table is there to show who was the bottleneck: a proxy that uses nearly all of its N cores
while the stubs' and load generators' cores have room to spare was measured at its limit.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

from loadtests.loadgen import Total
from loadtests.report import fmt, table
from loadtests.routing.report import percentile

SCALING_GOAL = 0.8  # req/s(N) >= 0.8 x N x req/s(1)
BUSY_WARNING = 0.85  # stubs or load generators busier than this may have capped the proxy
ROUTER = "sglang-router"


@dataclass
class Point:
    """One target measured at one N."""

    target: str
    workers: int  # N: worker processes (gateway) or threads (router); mini-lb is always 1
    cpus: str  # the proxy's CPUs, or "any" when nothing is pinned
    rps: float
    requests: int
    errors: int
    p50_ms: float | None
    p99_ms: float | None
    cpu_per_1k: float | None  # proxy CPU-seconds per 1000 requests
    proxy_cores: float | None  # proxy CPU-seconds per second
    process_min: float | None  # least busy of its N busiest processes below the root (cores)
    process_max: float | None
    stub_cores: float | None
    loadgen_cores: float | None
    other_cores: float | None  # everything else on the machine
    proxy_busy: float | None  # busy share of the proxy's CPUs (pinned runs only)
    stub_busy: float | None
    loadgen_busy: float | None
    events_per_s: float | None = None
    stream_errors: int = 0
    stream_cpu_per_1k_events: float | None = None


def _busy(cores: dict[str, float], group: list[int] | None, seconds: float) -> float | None:
    if not group or seconds <= 0:
        return None
    found = [cores[f"cpu{c}"] for c in group if f"cpu{c}" in cores]
    return statistics.mean(found) / seconds if found else None


def make_point(target: str, workers: int, proxy_pid: int, closed: Total,
               streamed: Total | None, groups: dict[str, list[int] | None]) -> Point:
    """`groups`: the CPUs of "proxy", "stubs" and "loads" (None when not pinned)."""
    usage, seconds = closed.usage, closed.seconds
    # The N busiest processes below the root: the workers (not the supervisor, nor helpers
    # such as multiprocessing's resource trackers); none for a single-process proxy.
    per_proc = sorted((cpu / seconds for pid, cpu in (usage.proxy_procs.items() if usage else ())
                       if pid != proxy_pid), reverse=True)[:workers] if seconds > 0 else []
    ms = sorted(x * 1e3 for x in closed.latencies)
    point = Point(
        target=target, workers=workers,
        cpus=",".join(map(str, groups["proxy"])) if groups["proxy"] else "any",
        rps=closed.rate, requests=closed.done, errors=closed.errors,
        p50_ms=percentile(ms, 50) if ms else None, p99_ms=percentile(ms, 99) if ms else None,
        cpu_per_1k=usage.proxy / closed.done * 1000 if usage and closed.done else None,
        proxy_cores=usage.proxy / seconds if usage else None,
        process_min=min(per_proc) if per_proc else None,
        process_max=max(per_proc) if per_proc else None,
        stub_cores=usage.backends / seconds if usage else None,
        loadgen_cores=usage.loadgen / seconds if usage else None,
        other_cores=usage.other / seconds if usage else None,
        proxy_busy=_busy(usage.cores, groups["proxy"], seconds) if usage else None,
        stub_busy=_busy(usage.cores, groups["stubs"], seconds) if usage else None,
        loadgen_busy=_busy(usage.cores, groups["loads"], seconds) if usage else None)
    if streamed is not None:
        point.events_per_s = streamed.rate
        point.stream_errors = streamed.errors
        if streamed.usage and streamed.events:
            point.stream_cpu_per_1k_events = streamed.usage.proxy / streamed.events * 1000
    return point


def _base(points: list[Point], target: str) -> Point | None:
    """The N = 1 point a target's efficiency is measured against."""
    for name in (target, "gateway" if target.startswith("gateway") else target):
        found = [p for p in points if p.target == name and p.workers == 1]
        if found:
            return found[0]
    return None


def efficiency(points: list[Point], point: Point) -> float | None:
    base = _base(points, point.target)
    if base is None or not base.rps:
        return None
    return point.rps / (point.workers * base.rps)


def _pct(value: float | None) -> str:
    return fmt(value * 100 if value is not None else None, 0, "%")


def throughput_table(points: list[Point], streams: bool) -> str:
    head = ["target", "N", "proxy CPUs", "req/s", "scaling: req/s / (N x req/s at N=1)", "errors",
            "p50 / p99 ms", "proxy CPU-s / 1k req", "proxy cores used",
            "per process min / max (cores)"]
    if streams:
        head += ["SSE events/s", "proxy CPU-s / 1k events", "stream errors"]
    rows = []
    for p in points:
        spread = ("-" if p.process_min is None
                  else f"{fmt(p.process_min, 2)} / {fmt(p.process_max, 2)}")
        cells = [p.target, str(p.workers), p.cpus, fmt(p.rps), fmt(efficiency(points, p), 2),
                 str(p.errors), f"{fmt(p.p50_ms, 2)} / {fmt(p.p99_ms, 2)}",
                 fmt(p.cpu_per_1k, 3), fmt(p.proxy_cores, 2), spread]
        if streams:
            cells += [fmt(p.events_per_s), fmt(p.stream_cpu_per_1k_events, 4),
                      str(p.stream_errors)]
        rows.append(cells)
    return table(head, rows)


def cpu_table(points: list[Point], stubs: int, loads: int) -> str:
    head = ["target", "N", "proxy (cores)", f"stubs, {stubs} procs (cores)",
            f"load generators, {loads} procs (cores)", "other (cores)", "proxy CPUs busy",
            "stub CPUs busy", "load CPUs busy"]
    rows = [[p.target, str(p.workers), fmt(p.proxy_cores, 2), fmt(p.stub_cores, 2),
             fmt(p.loadgen_cores, 2), fmt(p.other_cores, 2), _pct(p.proxy_busy),
             _pct(p.stub_busy), _pct(p.loadgen_busy)] for p in points]
    return table(head, rows)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def goals(points: list[Point]) -> list[tuple[str, str, bool | None]]:
    """(goal, measured, met): scaling of our targets at each N > 1, and ours against the
    Rust router at the largest N both were measured at."""
    out: list[tuple[str, str, bool | None]] = []
    for p in points:
        if p.target.startswith("gateway") and p.workers > 1:
            eff = efficiency(points, p)
            out.append((f"{p.target}: req/s at N={p.workers} >= {SCALING_GOAL} x N x req/s at "
                        "N=1", f"{fmt(eff, 2)} x N", None if eff is None else eff >= SCALING_GOAL))
    router = {p.workers: p for p in points if p.target == ROUTER}
    for name in dict.fromkeys(p.target for p in points if p.target.startswith("gateway")):
        ours = {p.workers: p for p in points if p.target == name}
        shared = sorted(set(ours) & set(router))
        if shared:
            n = shared[-1]
            ratio = _ratio(ours[n].rps, router[n].rps)
            out.append((f"{name}: req/s at N={n} >= {ROUTER}'s at N={n}",
                        f"{fmt(ratio, 2)}x the router's", None if ratio is None else ratio >= 1))
    return out


def goals_table(points: list[Point]) -> str:
    rows = [[goal, measured, "n/a" if met is None else ("met" if met else "NOT met")]
            for goal, measured, met in goals(points)]
    return table(["goal", "measured", "met"], rows) if rows else "(no goal measured)"


def ratios_table(points: list[Point]) -> str:
    """Ours over each peer at the same N (mini-lb: its one process at N = 1)."""
    peers = {(p.target, p.workers): p for p in points if not p.target.startswith("gateway")}
    rows = []
    for p in points:
        if not p.target.startswith("gateway"):
            continue
        for name in (ROUTER, "mini-lb"):
            peer = peers.get((name, p.workers if name == ROUTER else 1))
            if peer is None:
                continue
            label = name if name == ROUTER else f"{name} (1 process)"
            rows.append([f"{p.target} / {label}", str(p.workers),
                         fmt(_ratio(p.rps, peer.rps), 2, "x"),
                         fmt(_ratio(p.cpu_per_1k, peer.cpu_per_1k), 2, "x")])
    if not rows:
        return "(ratios need one of our targets and one peer)"
    return table(["ours / peer", "N", "req/s", "proxy CPU-s / 1k req"], rows)


def warnings(points: list[Point]) -> list[str]:
    """Points where the stubs or load generators, not the proxy, may have been the limit."""
    out = []
    for p in points:
        for what, busy in (("stub", p.stub_busy), ("load-generator", p.loadgen_busy)):
            if busy is not None and busy > BUSY_WARNING:
                out.append(f"{p.target} N={p.workers}: the {what} CPUs were {busy:.0%} busy; "
                           "the proxy may not have been the bottleneck")
    return out


def as_json(points: list[Point], settings: dict) -> dict:
    return {"settings": settings,
            "points": [{**asdict(p), "scaling": efficiency(points, p)} for p in points],
            "goals": [{"goal": g, "measured": m, "met": ok} for g, m, ok in goals(points)]}
