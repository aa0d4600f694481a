"""`gateway_panic_picks_total` with `--workers`: summed over the workers like every counter, and
never lower after a worker is started again.

It was the scheduler's per-process dict exported at scrape time: a scrape answered by another
worker read that worker's count (smaller), and a restarted worker read from 0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter

from gateway.observability.metrics import Tally

ROOT = Path(__file__).resolve().parents[3]

# One worker process: the gateway's metrics in multiprocess mode (as a worker builds them),
# a scheduler that made `picks` panic picks of the prefill, one flush, then what a scrape of
# this worker shows.
WORKER = """
import sys
from types import SimpleNamespace
from prometheus_client import CollectorRegistry, generate_latest
from gateway.observability.metrics import Metrics
from gateway.health.pairs import PairHealth
from gateway.servers.pool import ServerPool
metrics = Metrics(CollectorRegistry(), ServerPool(), multiprocess=True)
scheduler = SimpleNamespace(panics={"prefill": 0, "decode": 0}, pairs=PairHealth())
metrics.watch_scheduler(scheduler)
scheduler.panics["prefill"] += int(sys.argv[1])
metrics.flush()
sys.stdout.write(generate_latest(metrics.registry).decode())
"""


def panic_picks(exposition: str, role: str) -> float:
    lines = [line for line in exposition.splitlines()
             if line.startswith(f'gateway_panic_picks_total{{role="{role}"}} ')]
    assert len(lines) == 1, exposition
    return float(lines[0].rsplit(" ", 1)[1])


def scrape_of_worker(metrics_dir: Path, picks: int) -> str:
    """Run one worker to its end (its file stays, as the supervisor keeps a dead worker's)."""
    done = subprocess.run([sys.executable, "-c", WORKER, str(picks)], cwd=ROOT, timeout=60,
                          capture_output=True, text=True,
                          env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)})
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_panic_picks_are_summed_over_workers_and_survive_a_restart(tmp_path):
    first = scrape_of_worker(tmp_path, 3)  # worker 0
    assert panic_picks(first, "prefill") == 3
    second = scrape_of_worker(tmp_path, 2)  # worker 1: its scrape sums both
    assert panic_picks(second, "prefill") == 5
    restarted = scrape_of_worker(tmp_path, 1)  # worker 0 started again, its count from 0
    assert panic_picks(restarted, "prefill") == 6
    assert panic_picks(restarted, "decode") == 0


def test_a_tally_never_publishes_a_drop():
    counter = Counter("picks", "p", ["role"], registry=CollectorRegistry())
    counts = {"prefill": 4}
    tally = Tally(counts, counter)
    tally.publish()
    counts["prefill"] = 1  # a count kept elsewhere started again
    tally.publish()
    counts["prefill"] = 3
    tally.publish()
    assert counter.labels("prefill")._value.get() == 6
