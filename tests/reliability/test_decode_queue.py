"""Past capacity, queued is not hung on the decode: a stream waiting for the decode's batch.

Two decodes with a small KV pool (3,000 tokens: five 550-token requests each at once) and a
30 ms decode step get a burst of 50 streams of 150 tokens (4.5 s each): most wait in their
decode's admission queue once their KV is there. The simulator, as SGLang's decode, streams
the prefill's first token only when the request joins the running batch
(`process_batch_result_prebuilt`), so those streams are silent before their first chunk for up
to ~15 s, three times the 5 s floor of the learned deadline, while their decode serves the
others (SGLang's retraction silences a running one the same way, between two chunks). None may be cut: before `DecodeQueue`
(gateway/health/queue_wait.py) 84 streams were broken and continued on the other pair, their
prefill repeated, and 93 decode legs failed. A decode frozen in the middle of such a burst is
still found out, and its streams continue on the other one (docs/RELIABILITY.md, "Queued is
not hung").
"""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from tests.rigs.faults import unique_prompt, wait_until

PROMPT_TOKENS = 400
NEW_TOKENS = 150
SIM_ARGS = ("--max-total-tokens", "3000", "--token-delay", "0.03",
            "--waiting-timeout", "120", "--bootstrap-timeout", "120")
BURST = 50
FLOOR = 5.0  # the default --hang-floor


def stream(url: str, i: int) -> tuple[int, float, bool]:
    """(status, the longest silence: to the first chunk or between two, whether it ended
    with [DONE])."""
    body = {"text": unique_prompt(i, PROMPT_TOKENS), "stream": True, "sampling_params": {"max_new_tokens": NEW_TOKENS}}
    longest, last, tail = 0.0, time.monotonic(), b""
    with httpx.stream("POST", url + "/generate", json=body, timeout=120) as response:
        for chunk in response.iter_bytes():
            now = time.monotonic()
            if last is not None:
                longest = max(longest, now - last)
            last, tail = now, (tail + chunk)[-64:]
    return response.status_code, longest, tail.rstrip().endswith(b"data: [DONE]")


def burst(url: str, first: int, count: int) -> list[tuple[int, float, bool]]:
    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        return list(pool.map(lambda i: stream(url, i), range(first, first + count)))


def warm(url: str) -> None:
    """Teach the gateway the decodes' 30 ms gaps (a learned gap deadline of the 5 s floor)."""
    for round_ in range(4):
        assert all(o[0] == 200 and o[2] for o in burst(url, 1000 + 2 * round_, 2))


def waiting(rig, server) -> int:
    """Requests waiting for the server's batch, as its own /v1/loads says."""
    loads = rig.http.get(server.url + "/v1/loads").json()["loads"]
    return sum(entry["num_waiting_reqs"] for entry in loads)


@pytest.mark.timeout(180)
def test_a_stream_queued_on_its_decode_is_not_cut(make_rig, timing):
    rig = make_rig(sim_args=SIM_ARGS)
    warm(rig.gateway)
    outcomes = burst(rig.gateway, 0, BURST)
    assert all(status == 200 and done for status, _, done in outcomes), outcomes[:3]
    metrics = rig.metrics()
    broken = metrics.total("gateway_stream_failovers_total")
    failed = metrics.total("gateway_upstream_failures_total")
    retried = metrics.total("gateway_retries_total")
    assert (broken, failed, retried) == (0, 0, 0), \
        f"queued streams were cut: {broken} continued elsewhere, {failed} legs failed"
    longest = max(gap for _, gap, _ in outcomes)
    assert longest > 1.5 * FLOOR, f"no stream waited ({longest:.1f}s) past the gap deadline"
    served = sum(rig.stats(s)["completed"] for s in rig.prefill)
    assert served == BURST + 8, f"prefills computed {served} prompts: work was repeated"
    timing("decode queue (50 streams, 2 decodes of 5)", "longest silence of a stream", longest)


def moved_off(metrics) -> float:
    """Requests taken off a decode: retried before their first chunk, or continued."""
    return (metrics.total("gateway_stream_failovers_total")
            + metrics.total("gateway_retries_total", leg="decode"))


@pytest.mark.timeout(180)
def test_a_frozen_decode_under_overload_is_still_found_out(make_rig, timing):
    rig = make_rig(sim_args=SIM_ARGS)
    warm(rig.gateway)
    victim = rig.decode[0]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(burst, rig.gateway, 0, BURST)
        wait_until(lambda: waiting(rig, victim) > 0, 30, "requests queue on the decode")
        time.sleep(1.0)
        before = moved_off(rig.metrics())
        rig.freeze(victim)
        # its queued requests (no chunk yet) are retried, its started streams continued
        moved = wait_until(
            lambda: moved_off(rig.metrics()) > before, 30,
            "the requests on the frozen decode go elsewhere")
        outcomes = future.result(timeout=150)
    rig.thaw(victim)
    assert all(status == 200 and done for status, _, done in outcomes), \
        [o for o in outcomes if not (o[0] == 200 and o[2])][:3]
    # one learned gap deadline (the floor) after its last answered /v1/loads poll (2 s apart)
    assert moved < FLOOR + 4.0, f"the frozen decode held its requests {moved:.1f}s"
    timing("decode queue + frozen decode", "first stream continued after the freeze", moved)
