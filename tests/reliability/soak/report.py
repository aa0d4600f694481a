"""What one soak run found, and how it is printed (per run, and as a table of runs)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from tests.reliability.soak.schedule import Schedule

EXAMPLES = 3  # examples kept per failure kind
LINGER = 10.0  # a fault that ended this recently is still named beside a failure


@dataclass(frozen=True)
class Outcome:
    """One request: its kind, start (seconds into the run), latency, status and failure."""

    kind: str
    start: float
    latency: float
    status: int
    failure: tuple[str, str] | None


@dataclass
class SoakResult:
    seed: int
    seconds: float
    schedule: Schedule
    outcomes: list[Outcome] = field(default_factory=list)
    after: list[tuple[str, str]] = field(default_factory=list)  # leftovers after the run
    executor_errors: list[str] = field(default_factory=list)
    sim_faults: dict[str, int] = field(default_factory=dict)  # answers the sims broke
    servers: dict[str, str] = field(default_factory=dict)  # name -> URL, to read error texts
    measured: dict[str, object] = field(default_factory=dict)  # leftovers read after the run

    @property
    def requests(self) -> int:
        return len(self.outcomes)

    def faults_by_kind(self) -> Counter[str]:
        return Counter(f.kind for f in self.schedule.faults)

    def failures_by_kind(self) -> Counter[str]:
        found = Counter(o.failure[0] for o in self.outcomes if o.failure)
        found.update(kind for kind, _ in self.after)
        return found

    @property
    def failures(self) -> int:
        return sum(self.failures_by_kind().values())

    @property
    def worst_latency(self) -> float:
        return max((o.latency for o in self.outcomes), default=0.0)

    def replay(self) -> str:
        return f"python -m loadtests.soak --seed {self.seed} --seconds {self.seconds:g}"

    def examples(self) -> dict[str, list[str]]:
        """Up to EXAMPLES lines per failure kind, naming the faults around each failure."""
        out: dict[str, list[str]] = {}
        for o in self.outcomes:
            if o.failure is None or len(out.setdefault(o.failure[0], [])) >= EXAMPLES:
                continue
            around = self.schedule.active(o.start, o.start + o.latency, LINGER)
            faults = ", ".join(f.label() for f in around) or "none"
            out[o.failure[0]].append(self._named(
                f"t={o.start:.1f}s {o.kind} status={o.status} latency={o.latency:.1f}s: "
                f"{o.failure[1]} | faults (active or ended <{LINGER:g}s before): {faults}"))
        for kind, detail in self.after:
            out.setdefault(kind, []).append(self._named(f"after the run: {detail}"))
        return out

    def _named(self, text: str) -> str:
        """`text` with each server URL replaced by the server's name."""
        for name, url in self.servers.items():
            text = text.replace(url, name)
        return text

    def render(self) -> str:
        """The run's report: counts, failures by kind with examples, and how to replay it."""
        lines = [
            f"soak seed {self.seed}: {self.seconds:g}s, {self.requests} requests, "
            f"{self.failures} failures, worst latency {self.worst_latency:.1f}s",
            f"  faults by kind: {dict(sorted(self.faults_by_kind().items()))}",
            f"  answers the sims broke: {dict(sorted(self.sim_faults.items()))}",
            f"  requests by kind: {dict(sorted(Counter(o.kind for o in self.outcomes).items()))}",
            "  servers: " + ", ".join(f"{n} {u}" for n, u in self.servers.items()),
            f"  after the run: {self.measured}",
        ]
        lines += [f"  schedule: {f.label()}" for f in self.schedule.faults]
        for kind, examples in sorted(self.examples().items()):
            lines.append(f"  FAILED {kind}: {self.failures_by_kind()[kind]}")
            lines += [f"    {example}" for example in examples]
        lines += [f"  executor error: {error}" for error in self.executor_errors]
        if self.failures:
            lines.append(f"  replay: {self.replay()}")
        return "\n".join(lines)


def table(results: Sequence[SoakResult]) -> str:
    """One row per run: seed, minutes, requests, faults, failures by kind, worst latency."""
    rows = [("seed", "minutes", "requests", "faults", "failures", "worst latency")]
    for r in results:
        faults = ", ".join(f"{k} {v}" for k, v in sorted(r.faults_by_kind().items()))
        failures = ", ".join(f"{k} {v}" for k, v in sorted(r.failures_by_kind().items()))
        rows.append((str(r.seed), f"{r.seconds / 60:.1f}", str(r.requests), faults,
                     failures or "0", f"{r.worst_latency:.1f}s"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(" | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))
                     .rstrip() for row in rows)
