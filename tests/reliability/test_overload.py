"""Past capacity, queued is not hung: the first-progress deadline waits for a busy prefill.

A burst far past what 2 slowed prefills can serve at once (each prompt 0.5 s of prefill, 20
queued on each: the last waits about 10 s, twice the 5 s floor of the learned deadline) must
complete without one retry: every request waits its turn (docs/RELIABILITY.md, "Queued is
not hung"). A prefill frozen in the middle of such a burst is still found out within the
learned deadline and its requests move to the other one.
"""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from tests.rigs.faults import unique_prompt, wait_until

PROMPT_TOKENS = 500
MS_PER_TOKEN = 1.0  # 0.5 s of prefill per prompt: the queue, not the compute, is long
# the decodes wait for the KV and the prefills for their decode as long as the queue takes;
# a prefill step of 1,024 tokens lasts 1 s (8,192 would take 8 s, longer than the learned
# deadline: a server's count moves once a step, docs/RELIABILITY.md)
SIM_ARGS = ("--prefill-ms-per-token", str(MS_PER_TOKEN), "--waiting-timeout", "120",
            "--bootstrap-timeout", "120", "--chunked-prefill-size", "1024")
BURST = 40
FLOOR = 5.0  # the default --hang-floor


def one(url: str, i: int, timeout: float = 90.0) -> tuple[int, float, str]:
    started = time.monotonic()
    with httpx.Client(timeout=timeout) as client:
        r = client.post(url + "/generate", json={
            "text": unique_prompt(i, PROMPT_TOKENS), "sampling_params": {"max_new_tokens": 4}})
    return r.status_code, time.monotonic() - started, r.text[:300]


def burst(url: str, first: int, count: int) -> list[tuple[int, float, str]]:
    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        return list(pool.map(lambda i: one(url, i), range(first, first + count)))


def warm(url: str) -> None:
    """Teach the gateway the unloaded first-progress time (0.5 s: a 5 s deadline)."""
    for round_ in range(5):
        assert all(status == 200 for status, _, _ in burst(url, 1000 + 2 * round_, 2))


@pytest.mark.timeout(150)
def test_a_queue_longer_than_the_deadline_is_waited_for(make_rig, timing):
    rig = make_rig(sim_args=SIM_ARGS)
    warm(rig.gateway)
    outcomes = burst(rig.gateway, 0, BURST)
    bad = [o for o in outcomes if o[0] != 200]
    assert not bad, bad[:3]
    slowest = max(elapsed for _, elapsed, _ in outcomes)
    assert slowest > 1.5 * FLOOR, f"the queue ({slowest:.1f}s) never outgrew the floor"
    metrics = rig.metrics()
    retried = [(labels, value) for name, labels, value in metrics.samples
               if name == "gateway_retries_total" and value]
    assert not retried, ("a queued request was cut and retried", retried,
                         sorted(round(elapsed, 1) for _, elapsed, _ in outcomes))
    served = sum(rig.stats(s)["completed"] for s in rig.prefill)
    assert served == BURST + 10, f"prefills computed {served} prompts: work was repeated"
    timing("overload (40 x 0.5 s on 2 prefills)", "slowest request", slowest)


@pytest.mark.timeout(150)
def test_a_frozen_prefill_under_overload_is_still_found_out(make_rig, timing):
    rig = make_rig(sim_args=SIM_ARGS)
    warm(rig.gateway)
    victim = rig.prefill[0]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(burst, rig.gateway, 0, BURST)
        wait_until(lambda: rig.in_flight() >= BURST // 2, 20, "the burst is in flight")
        time.sleep(2.0)  # both queues are busy, neither is done
        at = rig.freeze(victim)
        moved = wait_until(lambda: rig.metrics().total("gateway_retries_total") > 0, 30,
                           "the attempts on the frozen prefill are retried")
        outcomes = future.result(timeout=120)
    rig.thaw(victim)
    assert all(status == 200 for status, _, _ in outcomes), \
        [o for o in outcomes if o[0] != 200][:3]
    # one learned deadline (the floor) after its last progress, plus a /v1/loads poll
    assert moved < FLOOR + 4.0, f"the frozen prefill held its requests {moved:.1f}s"
    timing("overload + frozen prefill", "first retry after the freeze", moved)
    del at
