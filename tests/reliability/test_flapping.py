"""A server whose /health flaps (`health_fail` toggled) while it still serves requests.

Hysteresis: --health-failures 4 consecutive failed checks mark it down, --health-successes 2
good ones mark it up again; a request that succeeded on it since the previous check counts as
a good check (SGLang's /health generates a token and is slow under load: slow is not dead).
"""

from __future__ import annotations

import random
import threading
import time

import pytest

from tests.rigs.faults import wait_until
from tests.rigs.load import Load, failures, summary

INTERVAL = 0.3
FAILURES = 4
SUCCESSES = 2
GATEWAY_ARGS = ("--health-interval", str(INTERVAL), "--health-timeout", "0.5",
                "--health-failures", str(FAILURES), "--health-successes", str(SUCCESSES),
                "--loads-interval", "0.5")


class HealthWatch:
    """Polls the gateway's view of one server in a thread; remembers every state it saw."""

    def __init__(self, rig, server) -> None:
        self.rig, self.server = rig, server
        self.seen: set[bool] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.seen.add(self.rig.snapshot(self.server)["healthy"])
            time.sleep(0.02)


def down_transitions(rig) -> int:
    return rig.gateway_proc.log().count("marked DOWN")


@pytest.mark.timeout(90)
def test_hysteresis_bounds_detection(make_rig, timing):
    rig = make_rig(*GATEWAY_ARGS, n_prefill=1)
    victim = rig.decode[0]
    healthy = lambda: rig.snapshot(victim)["healthy"]  # noqa: E731

    # blips shorter than one check interval never take the server out
    with HealthWatch(rig, victim) as watch:
        for _ in range(8):
            rig.fault(victim, health_fail=True)
            time.sleep(0.1)  # the blip
            rig.fault(victim, health_fail=False)
            time.sleep(2 * INTERVAL)  # long enough for good checks to reset the streak
    assert watch.seen == {True}, "a blip shorter than --health-failures checks marked it down"

    # a lasting failure takes it out no sooner than the hysteresis allows, and not much later
    rig.fault(victim, health_fail=True)
    down = wait_until(lambda: not healthy(), 10, "marked down after repeated failed checks")
    assert down >= (FAILURES - 1) * INTERVAL - 0.05
    timing("/health failing", f"marked down after ({FAILURES} x {INTERVAL}s checks)", down)
    rig.fault(victim, health_fail=False)
    up = wait_until(healthy, 10, "marked up after good checks")
    assert up >= (SUCCESSES - 1) * INTERVAL - 0.05
    timing("/health failing", f"marked up after ({SUCCESSES} x {INTERVAL}s checks)", up)
    assert rig.usable(victim)


@pytest.mark.timeout(90)
def test_flapping_health_fails_no_request(make_rig, timing):
    rig = make_rig(*GATEWAY_ARGS)
    victim = rig.decode[0]
    rng = random.Random(7)
    served = rig.stats(victim)["completed"]
    with Load(rig.gateway, loops=4, max_new_tokens=8, timeout=20) as load:
        load.wait_count(8, since=0, timeout=30)
        ends = time.monotonic() + 6
        while time.monotonic() < ends:  # failing phases both shorter and longer than 4 checks
            rig.fault(victim, health_fail=True)
            time.sleep(rng.uniform(0.1, 1.6))
            rig.fault(victim, health_fail=False)
            time.sleep(rng.uniform(0.1, 0.6))
        rig.fault(victim, health_fail=False)
        wait_until(lambda: rig.usable(victim), 10, "the flapping server ends in rotation")
    assert not failures(load.outcomes), summary(load.outcomes)
    assert rig.stats(victim)["completed"] > served, "the flapping server kept serving"
    timing("/health flapping under load", "times marked down", down_transitions(rig))
