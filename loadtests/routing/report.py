"""Figures of one target run, the results table, and the margin of ours over sglang-router.

Cache hit rate is the servers' own: cached over prompt tokens counted by the prefill servers
(`/metrics`), over every request they served in the window. The client's figure (the
`cached_tokens` the answers reported) is kept as a cross-check. TTFT is the client's: from
sending a streamed request to its first non-empty content. Requests/s and output tokens/s
count successful requests over the time from the start to the last answer.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from loadtests.procstat import Usage
from loadtests.routing.cluster import ServerFigures
from loadtests.routing.drive import Drive

REFERENCE = "sglang-router:cache_aware"


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


@dataclass(frozen=True)
class Row:
    target: str
    requests: int
    errors: int
    hit_rate: float  # servers' cached / prompt tokens
    client_hit_rate: float  # the same from the answers' usage figures
    ttft_p50_ms: float
    ttft_p99_ms: float
    ttft_mean_ms: float  # robust where p50 sits between a hit mode and a miss mode
    late_ttft_p50_ms: float  # third turn on of a conversation (chat); NaN without such turns
    requests_per_s: float
    output_tokens_per_s: float
    proxy_cpu_s: float
    own_cores: float  # proxy + servers + load generator, mean over the window
    busy_cores: float  # whole machine (other people's work included), mean over the window
    per_server: list[int]  # requests each prefill server received
    error_samples: list[str]
    policy: dict  # the gateway's view (routing decisions, predicted hits); {} for peers
    per_rank: list[list[int]] = field(default_factory=list)  # served, per prefill, per DP rank
    ttft_p90_ms: float = float("nan")

    def to_dict(self) -> dict:
        return asdict(self)


def make_row(target: str, drive: Drive, servers: ServerFigures, usage: Usage, window: float,
             policy: dict) -> Row:
    good = [s for s in drive.samples if s.reply.ok]
    errors = [s.reply.error or "?" for s in drive.samples if not s.reply.ok]
    ttfts = [s.reply.ttft * 1000 for s in good if s.reply.ttft is not None]
    late = [s.reply.ttft * 1000 for s in good if s.reply.ttft is not None and s.turn >= 2]
    prompt = sum(s.reply.prompt_tokens for s in good)
    cached = sum(s.reply.cached_tokens for s in good)
    elapsed = drive.elapsed or 1.0
    p50 = percentile(ttfts, 50) if ttfts else float("nan")
    return Row(
        target=target, requests=len(drive.samples), errors=len(errors),
        hit_rate=servers.hit_rate, client_hit_rate=cached / prompt if prompt else 0.0,
        ttft_p50_ms=p50, ttft_p99_ms=percentile(ttfts, 99) if ttfts else float("nan"),
        ttft_mean_ms=sum(ttfts) / len(ttfts) if ttfts else float("nan"),
        late_ttft_p50_ms=percentile(late, 50) if late else float("nan"),
        requests_per_s=len(good) / elapsed,
        output_tokens_per_s=sum(s.reply.output_tokens for s in good) / elapsed,
        proxy_cpu_s=usage.proxy, own_cores=(usage.proxy + usage.backends + usage.loadgen) / window,
        busy_cores=sum(usage.cores.values()) / window,
        per_server=list(servers.requests.values()), error_samples=sorted(set(errors))[:5],
        policy=policy, per_rank=[[r[0] for r in ranks] for ranks in servers.ranks.values()],
        ttft_p90_ms=percentile(ttfts, 90) if ttfts else float("nan"))


HEADER = ("target", "reqs", "errors", "hit rate", "client hit", "TTFT p50 ms", "TTFT p99 ms",
          "TTFT mean ms", "p50 turn>=3 ms", "req/s", "out tok/s", "proxy CPU s", "cores ours/all",
          "prefill share %")


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1f}"


def _share(counts: list[int]) -> str:
    total = sum(counts) or 1
    return "/".join(f"{100 * c / total:.0f}" for c in counts)


def cells(row: Row) -> list[str]:
    return [row.target, str(row.requests), str(row.errors), f"{100 * row.hit_rate:.1f}%",
            f"{100 * row.client_hit_rate:.1f}%", _ms(row.ttft_p50_ms), _ms(row.ttft_p99_ms),
            _ms(row.ttft_mean_ms), _ms(row.late_ttft_p50_ms),
            f"{row.requests_per_s:.2f}", f"{row.output_tokens_per_s:.0f}",
            f"{row.proxy_cpu_s:.2f}", f"{row.own_cores:.2f}/{row.busy_cores:.2f}",
            _share(row.per_server)]


def render_text(header: tuple[str, ...], lines: list[list[str]], left: int = 1) -> str:
    """Aligned columns: the first `left` to the left, the others to the right."""
    table = [list(header)] + lines
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) if i < left else c.rjust(w)
                               for i, (c, w) in enumerate(zip(line, widths, strict=True)))
                     for line in table)


def render_markdown(header: tuple[str, ...], lines: list[list[str]], left: int = 1) -> str:
    out = ["| " + " | ".join(header) + " |",
           "|" + "|".join("---" if i < left else "---:" for i in range(len(header))) + "|"]
    out += ["| " + " | ".join(line) + " |" for line in lines]
    return "\n".join(out)


def text_table(rows: list[Row]) -> str:
    return render_text(HEADER, [cells(r) for r in rows])


def markdown_table(rows: list[Row]) -> str:
    return render_markdown(HEADER, [cells(r) for r in rows])


def best_of_ours(rows: list[Row]) -> Row | None:
    """Our target with the lowest TTFT p50 among those without errors."""
    ours = [r for r in rows if r.target.startswith("gateway:") and not r.errors]
    return min(ours, key=lambda r: r.ttft_p50_ms, default=None)


def margin(rows: list[Row]) -> str:
    """One line: our best against sglang-router's cache_aware (TTFT p50 and hit rate)."""
    best = best_of_ours(rows)
    ref = next((r for r in rows if r.target == REFERENCE), None)
    if best is None or ref is None:
        return "margin: needs a gateway target and sglang-router:cache_aware"
    faster = ref.ttft_p50_ms - best.ttft_p50_ms
    return (f"margin of {best.target} over {REFERENCE}: TTFT p50 {best.ttft_p50_ms:.1f} vs "
            f"{ref.ttft_p50_ms:.1f} ms ({faster:+.1f} ms, {100 * faster / ref.ttft_p50_ms:+.0f}%"
            f" faster); hit rate {100 * best.hit_rate:.1f}% vs {100 * ref.hit_rate:.1f}% "
            f"({100 * (best.hit_rate - ref.hit_rate):+.1f} points)")
