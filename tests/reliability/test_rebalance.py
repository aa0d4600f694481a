"""--rebalance against real gateway and simulator processes: long prompts move a decode to
prefill, long outputs move it back, no request fails, the minimum of each role holds under
pressure that would ask for more; without the flag nothing switches, though the advice
(`gateway_desired_servers`) is published.

The simulated servers prefill slowly (0.5 ms a token: a 2,000-token prompt takes 1 s) and
run at most 4 requests at once, so a few client loops press either role.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.reliability.test_role_switch import FLAG, GATEWAY_ARGS, SwitchRig
from tests.rigs.faults import wait_until
from tests.rigs.load import Load, failures, send, summary

pytestmark = pytest.mark.timeout(240)

SLOW = ("--prefill-ms-per-token", "0.5", "--max-running-requests", "4")
REBALANCE = (*GATEWAY_ARGS, "--rebalance", "--rebalance-window", "2",
             "--rebalance-cooldown", "5")
DECISIONS = "gateway_rebalance_decisions_total"


@dataclass
class Shaped(Load):
    """Client loops with a prompt of `prompt_tokens` (the simulator's 4 bytes a token)."""

    prompt_tokens: int = 16

    def _loop(self, number: int) -> None:
        filler = " word" * max(0, self.prompt_tokens - 6)
        with httpx.Client(timeout=self.timeout) as client:
            while not self._stop.is_set():
                prompt = f"{os.urandom(6).hex()} loop {number}:{filler}"  # no shared prefix
                result = send(client, self.url, "/v1/chat/completions", True, prompt,
                              self.max_new_tokens)
                with self._lock:
                    self.outcomes.append(result)


def long_prompts(rig: SwitchRig) -> Shaped:
    return Shaped(rig.gateway, loops=4, timeout=60, max_new_tokens=4, prompt_tokens=2000)


def long_outputs(rig: SwitchRig) -> Shaped:
    return Shaped(rig.gateway, loops=10, timeout=60, max_new_tokens=120, prompt_tokens=16)


def roles(rig: SwitchRig) -> dict[str, int]:
    counts = {"prefill": 0, "decode": 0}
    for snap in rig.snapshots().values():
        if snap["healthy"] and not snap["draining"]:
            counts[snap["role"]] += 1
    return counts


@pytest.fixture
def rig(tmp_path) -> Iterator:
    with contextlib.ExitStack() as stack:
        def make(gateway_args: tuple[str, ...], n_decode: int = 2) -> SwitchRig:
            made = SwitchRig(tmp_path, gateway_args, 1, n_decode, (FLAG, *SLOW))
            stack.callback(made.close)
            return made.start()

        yield make


def test_long_prompts_take_a_decode_and_long_outputs_give_it_back(rig):
    rig = rig(REBALANCE)
    outcomes = []
    with long_prompts(rig) as load:
        wait_until(lambda: roles(rig) == {"prefill": 2, "decode": 1}, 60,
                   "a decode switched to prefill", detail=lambda: roles(rig))
        first = time.monotonic()
        # the prefills stay pressed, but the last decode is the minimum: past the cool-down
        # and a window, nothing more moves
        while time.monotonic() < first + 9:
            assert roles(rig)["decode"] == 1, roles(rig)
            time.sleep(0.2)
        outcomes += load.stop()
    metrics = rig.metrics()
    assert metrics.total(DECISIONS, **{"from": "decode", "to": "prefill",
                                       "outcome": "switched"}) == 1
    assert metrics.total(DECISIONS) == 1
    with long_outputs(rig) as load:
        wait_until(lambda: roles(rig) == {"prefill": 1, "decode": 2}, 60,
                   "a prefill switched back to decode", detail=lambda: roles(rig))
        load.wait_count(len(load.outcomes) + 10, 0, 30)  # both decodes serve on
        outcomes += load.stop()
    assert not failures(outcomes), summary(outcomes)
    assert len(outcomes) >= 40
    metrics = rig.metrics()
    assert metrics.total(DECISIONS, **{"from": "prefill", "to": "decode",
                                       "reason": "decode_slots", "outcome": "switched"}) == 1
    log = rig.gateway_proc.log()
    assert "rebalance: switching" in log
    assert "prefill_busy" in log or "prefill_queue" in log


def test_off_by_default_it_only_advises(rig):
    rig = rig(GATEWAY_ARGS)
    with long_prompts(rig) as load:
        wait_until(lambda: rig.metrics().total("gateway_desired_servers", role="prefill") >= 2,
                   30, "the advice: more prefill servers")
        time.sleep(4)  # two windows of the test above: it would have switched by now
        outcomes = load.stop()
    assert not failures(outcomes), summary(outcomes)
    assert roles(rig) == {"prefill": 1, "decode": 2}
    assert rig.metrics().total(DECISIONS) == 0
    assert rig.metrics().value("gateway_desired_servers", role="decode") == 1


def test_with_workers_one_process_decides(rig):
    """Each worker reads the same pressure and keeps its own cool-down; worker 0 alone asks,
    so the prefills, pressed still, get no second server before the cool-down is over (a
    second decider, with no cool-down of its own yet, would switch within a reading). The
    cool-down runs from the end of the switch: counted from its start, a drain slowed by a
    busy machine left less than the 3.5 s watched here."""
    rig = rig((*REBALANCE, "--workers", "2"), n_decode=3)
    with long_prompts(rig) as load:
        wait_until(lambda: roles(rig)["prefill"] == 2, 60, "a decode switched to prefill",
                   detail=lambda: roles(rig))
        first = time.monotonic()
        while time.monotonic() < first + 3.5:  # within the 5 s cool-down
            assert roles(rig) == {"prefill": 2, "decode": 2}, roles(rig)
            time.sleep(0.2)
        outcomes = load.stop()
    assert not failures(outcomes), summary(outcomes)
    assert rig.metrics().total(DECISIONS) == 1
