"""Medians over rounds, ratios to the peers, the issue's targets, as Markdown tables."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field


@dataclass
class Run:
    """One target measured once (one round)."""

    target: str
    round: int
    rps: float
    errors: int
    cpu_per_1k: float | None  # proxy CPU-seconds per 1000 requests (closed loop)
    proxy_busy: float | None  # proxy CPU-seconds per second in the closed loop (1.0 = a core)
    backend_busy: float
    loadgen_busy: float
    other_busy: float  # cores used by other processes during the whole measurement
    open_loop: dict[str, dict] = field(default_factory=dict)  # rate -> p50_ms, p99_ms, errors
    events_per_s: float = 0.0
    stream_errors: int = 0
    stream_cpu_per_1k_events: float | None = None
    stream_proxy_busy: float | None = None
    stream_first_event_ms: float | None = None  # p50 from a stream's request to its first event
    alone_first_event_ms: float | None = None  # the same, one stream at a time (no queueing)
    rss_mb: float | None = None
    cores: dict[str, float] = field(default_factory=dict)  # busy fraction per core, closed loop
    stream_cores: dict[str, float] = field(default_factory=dict)  # the same, streams
    attempts: int = 1  # measurements made; more than 1 when other work disturbed the first


def _median(values):
    values = [v for v in values if v is not None]
    if not values:
        return None
    return statistics.median(values)


def _added(value: float | None, floor: float | None) -> float | None:
    """Latency over the floor's; unknown when the floor itself was overloaded."""
    if value is None or floor is None or math.isinf(floor):
        return None
    return value - floor


def summarize(runs: list[Run]) -> dict[str, dict]:
    """Per target, the median of every figure over its rounds (errors are summed)."""
    out: dict[str, dict] = {}
    for name in dict.fromkeys(r.target for r in runs):
        mine = [r for r in runs if r.target == name]
        row = {key: _median([getattr(r, key) for r in mine]) for key in (
            "rps", "cpu_per_1k", "proxy_busy", "backend_busy", "loadgen_busy", "other_busy",
            "events_per_s", "stream_cpu_per_1k_events", "stream_proxy_busy",
            "stream_first_event_ms", "alone_first_event_ms", "rss_mb")}
        for key in ("cores", "stream_cores"):
            row[key] = {core: _median([r.__dict__[key].get(core) for r in mine])
                        for core in getattr(mine[0], key)}
        row["errors"] = sum(r.errors + r.stream_errors for r in mine)
        row["rounds"] = len(mine)
        row["open_loop"] = {}
        for rate in mine[0].open_loop:
            points = [r.open_loop[rate] for r in mine if rate in r.open_loop]
            row["open_loop"][rate] = {
                "p50_ms": _median([p["p50_ms"] for p in points]),
                "p99_ms": _median([p["p99_ms"] for p in points]),
                "errors": sum(p["errors"] for p in points)}
        out[name] = row
    floor = out.get("floor")
    for row in out.values():
        for rate, point in row["open_loop"].items():
            base = floor["open_loop"].get(rate) if floor else None
            point["added_p50_ms"] = _added(point["p50_ms"], base and base["p50_ms"])
            point["added_p99_ms"] = _added(point["p99_ms"], base and base["p99_ms"])
    return out


def fmt(value, digits: int = 0, suffix: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isinf(value):
        return "overload"
    return f"{value:,.{digits}f}{suffix}"


def table(head: list[str], rows: list[list[str]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in rows])


def results_table(summary: dict[str, dict]) -> str:
    rates = list(next(iter(summary.values()))["open_loop"]) if summary else []
    head = ["target", "req/s (64 conn)", "proxy CPU-s / 1k req", "req / proxy CPU-s",
            "proxy core busy"]
    for rate in rates:
        head.append(f"p50 / p99 ms @{rate}/s")
        head.append(f"added p99 ms @{rate}/s")
    head += ["SSE events/s (64 streams)", "proxy CPU-s / 1k events",
             "stream first event p50 ms (1 / 64 streams)", "peak RSS MB", "errors"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, row in summary.items():
        cpu = row["cpu_per_1k"]
        cells = [name, fmt(row["rps"]), fmt(cpu, 3), fmt(1000 / cpu if cpu else None),
                 fmt(row["proxy_busy"] * 100 if row["proxy_busy"] is not None else None, 0,
                      "%")]
        for rate in rates:
            point = row["open_loop"][rate]
            cells.append(f"{fmt(point['p50_ms'], 2)} / {fmt(point['p99_ms'], 2)}")
            cells.append(fmt(point["added_p99_ms"], 2))
        cells += [fmt(row["events_per_s"]), fmt(row["stream_cpu_per_1k_events"], 4),
                  f"{fmt(row.get('alone_first_event_ms'), 2)} / "
                  f"{fmt(row.get('stream_first_event_ms'), 2)}", fmt(row["rss_mb"], 0),
                  str(row["errors"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ratio(a, b) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def ratios_table(summary: dict[str, dict]) -> str:
    ours = [n for n in summary if n.startswith("gateway")]
    peers = [n for n in ("sglang-router", "mini-lb") if n in summary]
    if not ours or not peers:
        return "(ratios need one of our targets and one peer)"
    head = ["ours vs peer", "req/s", "req per CPU-s", "CPU-s / 1k req", "SSE events/s",
            "CPU-s / 1k events", "stream first event", "peak RSS"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for us in ours:
        for peer in peers:
            a, b = summary[us], summary[peer]
            cells = [f"{us} / {peer}", fmt(_ratio(a["rps"], b["rps"]), 2, "x"),
                     fmt(_ratio(b["cpu_per_1k"], a["cpu_per_1k"]), 2, "x"),
                     fmt(_ratio(a["cpu_per_1k"], b["cpu_per_1k"]), 2, "x"),
                     fmt(_ratio(a["events_per_s"], b["events_per_s"]), 2, "x"),
                     fmt(_ratio(a["stream_cpu_per_1k_events"], b["stream_cpu_per_1k_events"]),
                         2, "x"),
                     fmt(_ratio(a.get("stream_first_event_ms"), b.get("stream_first_event_ms")),
                         2, "x"),
                     fmt(_ratio(a["rss_mb"], b["rss_mb"]), 2, "x")]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def goals(summary: dict[str, dict], ours: str = "gateway") -> list[tuple[str, str, bool | None]]:
    """The issues' targets for one of our targets: (goal, measured, met)."""
    us = summary.get(ours)
    if us is None:
        return []
    router, mini = summary.get("sglang-router"), summary.get("mini-lb")
    out: list[tuple[str, str, bool | None]] = []
    ratio = _ratio(mini["cpu_per_1k"], us["cpu_per_1k"]) if mini else None
    out.append(("at least 4x mini_lb's requests per CPU-second",
                f"{fmt(ratio, 2)}x", None if ratio is None else ratio >= 4))
    ratio = _ratio(us["cpu_per_1k"], router["cpu_per_1k"]) if router else None
    out.append(("CPU-seconds per 1000 requests within 2x of the Rust router's",
                f"{fmt(ratio, 2)}x the router's", None if ratio is None else ratio <= 2))
    rate = "1000" if "1000" in us["open_loop"] else None
    added = us["open_loop"][rate]["added_p99_ms"] if rate else None
    out.append(("p99 added latency at 1000 req/s under 5 ms", f"{fmt(added, 2)} ms",
                None if added is None else added < 5))
    ratio = _ratio(us["events_per_s"], router["events_per_s"]) if router else None
    out.append(("streaming throughput within 10% of the Rust router's",
                f"{fmt(ratio, 2)}x the router's", None if ratio is None else ratio >= 0.9))
    # issue 14's one-core goals, both from this one run
    ratio = _ratio(us["cpu_per_1k"], router["cpu_per_1k"]) if router else None
    out.append(("CPU-seconds per 1000 requests at most 1.25x the Rust router's",
                f"{fmt(ratio, 2)}x the router's", None if ratio is None else ratio <= 1.25))
    ratio = _ratio(us["stream_cpu_per_1k_events"],
                   router["stream_cpu_per_1k_events"]) if router else None
    out.append(("CPU-seconds per 1000 streamed events at most 1.1x the Rust router's",
                f"{fmt(ratio, 2)}x the router's", None if ratio is None else ratio <= 1.1))
    for key, load in (("alone_first_event_ms", "one stream at a time"),
                      ("stream_first_event_ms", "64 streams")):
        mine, theirs = us.get(key), router and router.get(key)
        out.append((f"stream first event (p50, {load}) no later than the Rust router's",
                    f"{fmt(mine, 2)} vs {fmt(theirs, 2)} ms",
                    None if mine is None or theirs is None else mine <= theirs))
    return out


def goals_table(summary: dict[str, dict]) -> str:
    lines = ["| target | goal | measured | met |", "|---|---|---|---|"]
    for ours in (n for n in summary if n.startswith("gateway")):
        for goal, measured, met in goals(summary, ours):
            verdict = "n/a" if met is None else ("met" if met else "NOT met")
            lines.append(f"| {ours} | {goal} | {measured} | {verdict} |")
    return "\n".join(lines)


CLIENTS = (("gateway-own", "own (fast)"), ("gateway-aiohttp", "aiohttp"),
           ("gateway-httpx", "httpx"))
AIOHTTP_BAR = 1.15  # aiohttp becomes the default client if its CPU per request is within this


def clients_table(summary: dict[str, dict], runs: list[Run] | None = None) -> str:
    """The three data-path clients side by side, each relative to the own client; with the
    runs, also aiohttp's CPU per request over the own client's in each round (both measured
    minutes apart, so other work on the machine disturbs them alike)."""
    present = [(name, label) for name, label in CLIENTS if name in summary]
    if not present:
        return "(no gateway-own / gateway-aiohttp / gateway-httpx target measured)"
    own = summary.get("gateway-own")
    head = ["data-path client", "req/s (64 conn)", "proxy CPU-s / 1k req", "vs own",
            "SSE events/s", "vs own", "proxy CPU-s / 1k events", "vs own", "peak RSS MB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, label in present:
        row = summary[name]
        cells = [f"{label} (`{name}`)", fmt(row["rps"]), fmt(row["cpu_per_1k"], 3),
                 fmt(_ratio(row["cpu_per_1k"], own and own["cpu_per_1k"]), 2, "x"),
                 fmt(row["events_per_s"]),
                 fmt(_ratio(row["events_per_s"], own and own["events_per_s"]), 2, "x"),
                 fmt(row["stream_cpu_per_1k_events"], 4),
                 fmt(_ratio(row["stream_cpu_per_1k_events"],
                             own and own["stream_cpu_per_1k_events"]), 2, "x"),
                 fmt(row["rss_mb"], 0)]
        lines.append("| " + " | ".join(cells) + " |")
    aio = summary.get("gateway-aiohttp")
    ratio = _ratio(aio and aio["cpu_per_1k"], own and own["cpu_per_1k"])
    if ratio is not None:
        verdict = "within" if ratio <= AIOHTTP_BAR else "over"
        lines.append("")
        lines.append(f"aiohttp costs {ratio:.2f}x the own client's CPU per request: {verdict} "
                     f"the {AIOHTTP_BAR:.2f}x bar for making it the default.")
        per_round = _round_ratios(runs or [], "gateway-aiohttp", "gateway-own")
        if per_round:
            lines.append("")
            lines.append("Per round (aiohttp / own, CPU per request; CPU per event): "
                         + ", ".join(f"{a:.2f}x; {b:.2f}x" for a, b in per_round) + ".")
    return "\n".join(lines)


def _round_ratios(runs: list[Run], a: str, b: str) -> list[tuple[float, float]]:
    out = []
    for number in sorted({r.round for r in runs}):
        mine = {r.target: r for r in runs if r.round == number}
        if a in mine and b in mine:
            cpu = _ratio(mine[a].cpu_per_1k, mine[b].cpu_per_1k)
            events = _ratio(mine[a].stream_cpu_per_1k_events, mine[b].stream_cpu_per_1k_events)
            if cpu is not None and events is not None:
                out.append((cpu, events))
    return out


def noise_table(summary: dict[str, dict]) -> str:
    """Where the CPU went, in cores (1.0 = one core fully busy), and how busy each core was."""
    cores = sorted({c for row in summary.values() for c in row["cores"]})
    head = ["target", "proxy", "servers", "load generator", "other processes"]
    head += [f"{c} busy (closed / streams)" for c in cores]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, row in summary.items():
        cells = [name, fmt(row["proxy_busy"], 2), fmt(row["backend_busy"], 2),
                 fmt(row["loadgen_busy"], 2), fmt(row["other_busy"], 2)]
        for c in cores:
            closed, streams = row["cores"].get(c), row["stream_cores"].get(c)
            cells.append(f"{fmt(closed and closed * 100, 0, '%')} / "
                         f"{fmt(streams and streams * 100, 0, '%')}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def as_json(runs: list[Run], summary: dict[str, dict], settings: dict) -> dict:
    return {"settings": settings, "summary": summary, "runs": [asdict(r) for r in runs]}
