"""The simulator's timing model: the GPU table, the fitted profile, and what the engine does.

The profiles in backends/sim/timing.py claim a maximum fit error over the committed
loadtests/calibration/ tables; these tests hold them to it, check that the fit script finds the
same coefficients again, and that the engine (in process, and a real sim process seen from a
client) spends the time the profile predicts.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest

from backends.sim.config import config_from_args
from backends.sim.engine import Engine
from backends.sim.job import ItemSpec, Job
from backends.sim.radix import RadixCache
from backends.sim.timing import H100_8B_ESTIMATE, H200_LLAMA3_8B, H200_QWEN25_32B, PROFILES
from loadtests.calibration.fit import fit_table
from tests.sim.simproc import Sim

CALIBRATION = Path(__file__).resolve().parents[2] / "loadtests" / "calibration"
# (profile, table file, model, stated max relative error of prefill, of decode)
FITS = [
    (H200_LLAMA3_8B, "h200_llama3_8b.json", "llama3-8b", 0.066, 0.026),
    (H200_QWEN25_32B, "h200_qwen25_32b.json", "qwen2.5-32b", 0.023, 0.007),
]
ROUNDING = 0.002  # the profiles keep 5 significant digits


def _table(name: str, model: str) -> dict:
    return json.loads((CALIBRATION / name).read_text())["models"][model]


@pytest.mark.parametrize(("profile", "name", "model", "p_err", "d_err"), FITS,
                         ids=["llama3-8b", "qwen2.5-32b"])
def test_profile_reproduces_its_table_within_the_stated_error(profile, name, model, p_err,
                                                              d_err):
    table = _table(name, model)
    assert table["kv_bytes_per_token"] == profile.kv_bytes_per_token
    for row in table["prefill"]:
        got = profile.prefill_ms(row["new"], row["cached"])
        assert abs(got / row["ms"] - 1) <= p_err + ROUNDING, row
    for row in table["decode"]:
        got = profile.decode_ms(row["batch"], row["batch"] * row["ctx"])
        assert abs(got / row["ms"] - 1) <= d_err + ROUNDING, row


@pytest.mark.parametrize(("profile", "name", "model", "p_err", "d_err"), FITS,
                         ids=["llama3-8b", "qwen2.5-32b"])
def test_fit_script_finds_the_profile_again(profile, name, model, p_err, d_err):
    table = json.loads((CALIBRATION / name).read_text())
    fit = fit_table(table, model)[model]
    assert fit["prefill_max_rel_error"] == pytest.approx(p_err, abs=0.001)
    assert fit["decode_max_rel_error"] == pytest.approx(d_err, abs=0.001)
    for key, value in {**fit["prefill"], **fit["decode"]}.items():
        assert getattr(profile, key) == pytest.approx(value, rel=1e-3), key
    assert profile.transfer_ms_per_token == pytest.approx(fit["transfer_ms_per_token"], rel=0.01)


def test_timing_flag_picks_a_profile_and_knob_flags_override_it():
    default = config_from_args([])  # the sim's default stays the estimate (timing.py: why)
    assert default.timing == "h100-8b-estimate"
    assert default.prefill_ms_per_token == H100_8B_ESTIMATE.prefill_ms_per_token
    calibrated = config_from_args(["--timing", "h200-llama3-8b"])
    assert calibrated.prefill_floor_ms == H200_LLAMA3_8B.prefill_floor_ms
    assert calibrated.decode_step_ms == H200_LLAMA3_8B.decode_step_ms
    mixed = config_from_args(["--timing", "h200-llama3-8b", "--decode-step-ms", "3"])
    assert mixed.decode_step_ms == 3.0
    assert mixed.prefill_ms_per_mpair_cached == H200_LLAMA3_8B.prefill_ms_per_mpair_cached
    fast = config_from_args(["--timing", "h200-llama3-8b", "--fast"])
    assert fast.prefill_floor_ms == 0 and fast.prefill_ms_per_mpair_new == 0


def test_old_estimate_profile_keeps_the_old_formula():
    p = PROFILES["h100-8b-estimate"]
    assert p.prefill_ms(2048, 4096) == pytest.approx(5.0 + 0.05 * 2048)
    assert p.decode_ms(64, 64 * 2048) == pytest.approx(7.0 + 0.07 * 64 + 0.00004 * 64 * 2048)


def test_prefill_attention_and_floor_terms():
    p = H200_LLAMA3_8B
    assert p.prefill_ms(256, 8192) == pytest.approx(p.prefill_floor_ms + 8192
                                                    * p.prefill_floor_ms_per_cached_token)
    long_prefix = p.prefill_ms(4096, 8192) - p.prefill_ms(4096, 0)
    assert long_prefix == pytest.approx(p.prefill_ms_per_mpair_cached * 4096 * 8192 / 1e6)
    two = p.prefill_batch_ms([(1024, 0), (1024, 2048)])
    assert two < p.prefill_ms(1024) + p.prefill_ms(1024, 2048)  # one launch floor, shared
    assert p.prefill_chunked_ms(16384, 0, 8192) == pytest.approx(
        p.prefill_ms(8192, 0) + p.prefill_ms(8192, 8192))


def _run_engine(jobs_in_turns: list[list[Job]], prefix: list[int] | None = None,
                waiting: list[int] | None = None) -> list[tuple[str, float]]:
    """Run jobs through an Engine timed by H200_LLAMA3_8B; the steps' modelled seconds
    (and into `waiting`, the engine's reported waiting uncached tokens as each prefill
    batch starts).

    Steps end in the next loop callback rather than after their time, so the test is quick."""
    config = config_from_args(["--mode", "null", "--timing", "h200-llama3-8b"])
    cache = RadixCache(page_size=1, capacity=config.cache_capacity_tokens)
    if prefix:
        cache.insert(prefix)
    engine = Engine(config, cache)
    steps: list[tuple[str, float]] = []
    original = engine._after

    def record(started, seconds, step_end, *args):
        steps.append((step_end.__name__, seconds))
        if waiting is not None and step_end.__name__ == "_end_prefill":
            waiting.append(engine.waiting_uncached_tokens)
        original(started, 0.0, step_end, *args)

    engine._after = record  # type: ignore[method-assign]

    async def main() -> None:
        engine.start()
        for turn in jobs_in_turns:
            for job in turn:
                engine.submit_prefill(job)
            while not all(j.done for j in turn):
                await asyncio.sleep(0)
        await engine.stop()

    asyncio.run(main())
    return steps


def _job(tokens: list[int], max_new: int) -> Job:
    return Job(spec=ItemSpec(index=0, rid=f"r{len(tokens)}", input_ids=tokens, text=None,
                             max_new_tokens=max_new))


def test_engine_steps_follow_the_profile_chunked_cached_and_decode():
    p = H200_LLAMA3_8B
    prompt = list(range(1, 20_001))
    steps = _run_engine([[_job(prompt, 3)]])
    prefill = [s for name, s in steps if name == "_end_prefill"]
    decode = [s for name, s in steps if name == "_end_decode"]
    # --chunked-prefill-size 8192: each chunk attends over the chunks before it
    assert prefill == pytest.approx([p.prefill_ms(8192, 0) / 1e3, p.prefill_ms(8192, 8192) / 1e3,
                                     p.prefill_ms(3616, 16384) / 1e3])
    assert decode == pytest.approx([p.decode_ms(1, 20_001) / 1e3, p.decode_ms(1, 20_002) / 1e3])

    shared = list(range(100_000, 108_192))
    steps = _run_engine([[_job(shared + [7] * 256, 1), _job([5] * 1000, 1)]], prefix=shared)
    assert [s for _, s in steps] == pytest.approx(
        [p.prefill_batch_ms([(256, 8192), (1000, 0)]) / 1e3])


def test_steps_run_back_to_back_on_the_modelled_gpu():
    """The CPU work between two steps (each woken stream writing its token) does not push
    the next step back while it is shorter than a step: SGLang's overlap loops launch the
    next batch before processing the last one's result. After an idle GPU, or a loop more
    than a step late, a step starts when it is launched."""
    config = config_from_args(["--mode", "decode", "--timing", "h200-llama3-8b"])
    engine = Engine(config, RadixCache(page_size=1, capacity=config.cache_capacity_tokens))
    assert engine._on_gpu(10.0, 0.010) == 10.0  # idle until now
    assert engine._on_gpu(10.013, 0.010) == pytest.approx(10.010)  # 3 ms of streaming
    assert engine._on_gpu(10.0205, 0.010) == pytest.approx(10.020)  # and again
    assert engine._on_gpu(10.045, 0.010) == pytest.approx(10.045)  # 15 ms late: idle between
    assert engine._on_gpu(10.055, 0.012) == pytest.approx(10.055)  # on time
    engine._idle()  # nothing to run, then a new request 5 ms after the last step's end:
    assert engine._on_gpu(10.072, 0.020) == pytest.approx(10.072)  # not before it came


def _timed_generate(sim: Sim, tokens: list[int], max_new: int) -> float:
    body = {"input_ids": tokens, "sampling_params": {"max_new_tokens": max_new}}
    start = time.perf_counter()
    r = httpx.post(sim.url + "/generate", json=body, timeout=30.0)
    assert r.status_code == 200, r.text
    return time.perf_counter() - start


def _busy_us(sim: Sim) -> int:
    return sim.get("/v1/loads").json()["loads"][0]["total_prefill_busy_us"]


def test_sim_process_prefill_and_decode_take_the_profiles_time(sim_factory):
    """A real sim with --timing h200-llama3-8b, seen from a client: its reported prefill busy time
    is the profile's for each chunk of a 12k prompt, and neither that prompt's prefill nor 100
    decode steps end sooner than H200_LLAMA3_8B predicts (later only by the loop's lateness on
    this busy machine, so that bound is loose)."""
    p = H200_LLAMA3_8B
    sim = sim_factory("null", "--timing", "h200-llama3-8b", fast=False)
    _timed_generate(sim, [3] * 16, 1)  # warm the connection path
    busy = _busy_us(sim)
    prompt = list(range(50_000, 62_288))
    prefill_s = (p.prefill_ms(8192, 0) + p.prefill_ms(4096, 8192)) / 1e3
    first = _timed_generate(sim, prompt, 1)
    assert _busy_us(sim) - busy == pytest.approx(prefill_s * 1e6, abs=2)
    assert prefill_s * 0.99 <= first <= prefill_s * 2 + 0.5
    other = list(range(70_000, 78_192))
    decode_s = sum(p.decode_ms(1, 8192 + i) for i in range(1, 101)) / 1e3
    whole = _timed_generate(sim, other, 101) - p.prefill_ms(8192, 0) / 1e3
    assert decode_s * 0.99 <= whole <= decode_s * 2 + 0.5


def test_queued_prompts_count_as_waiting_until_their_batch_runs():
    """`num_waiting_uncached_tokens` as SGLang's `get_num_waiting_uncached_tokens` counts it
    while a batch runs: every prompt not yet in a batch, plus what the chunked one has left.
    (The engine admits requests to its prefill list at once; counting only its admission
    queue hid a long prefill queue from the gateway's forecasts.)"""
    seen: list[int] = []
    _run_engine([[_job(list(range(1, 20_001)), 1), _job(list(range(30_000, 35_000)), 1)]],
                waiting=seen)
    # chunks of 8192: the first prompt's 20,000 in three, the second's 5,000 behind them
    assert seen == [20_000 - 8192 + 5000, 20_000 - 2 * 8192 + 5000, 5000 - (8192 - 3616), 0]
