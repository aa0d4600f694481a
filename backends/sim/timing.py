"""How long the simulated GPU takes: the timing profiles and the formulas that use them.

A profile is a frozen set of coefficients; the simulator's engine, its KV transfer and the
goodput benchmark's capacity bound all ask the same three questions of it, so they share one
physics:

    prefill batch ms = max(floor_ms + floor_ms_per_cached_token * sum(cached_i),
                           overhead_ms + ms_per_token * sum(new_i)
                           + ms_per_mpair_new * sum(new_i^2 / 2) / 1e6
                           + ms_per_mpair_cached * sum(new_i * cached_i) / 1e6)
    decode step ms   = step_ms + ms_per_req * batch + ms_per_kv_token * context tokens
    KV transfer ms   = transfer_overhead_ms + transfer_ms_per_token * prompt tokens

`new_i` are the tokens a request extends in this batch and `cached_i` the tokens whose KV is
already in the pool before it (the prefix-cache hit plus earlier chunks of the same prompt).
docs/SIMULATOR.md derives each term; `loadtests/calibration/fit.py` refits them from a
`loadtests/gpu_calibrate.py` table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class TimingProfile:
    """Coefficients of one model on one GPU (milliseconds; token counts as given)."""

    name: str
    source: str  # where the figures come from
    kv_bytes_per_token: int
    # prefill: SGLang's extend batch (ScheduleBatch in ForwardMode.EXTEND, run eagerly by
    # ModelRunner.forward_extend). The compute branch is the GEMMs (linear in the new tokens)
    # plus attention, which FlashInfer's extend runs as two kernels: the new tokens against
    # each other (ragged, causal: n^2/2 pairs) and against the cached prefix (paged: n * c
    # pairs). The floor is the eager launch cost of a short batch, which grows with the
    # prefix its attention kernels walk.
    prefill_overhead_ms: float
    prefill_ms_per_token: float
    prefill_ms_per_mpair_new: float
    prefill_ms_per_mpair_cached: float
    prefill_floor_ms: float
    prefill_floor_ms_per_cached_token: float
    # decode: ModelRunner.forward_decode replayed from CudaGraphRunner's graph for the batch
    # size: a weight read per step (step_ms), per-request GEMM rows, sampling and logits
    # (ms_per_req), and the KV read of every context token in the batch (ms_per_kv_token).
    decode_step_ms: float
    decode_ms_per_req: float
    decode_ms_per_kv_token: float
    # transfer: the prefill's KV sender (disaggregation/mooncake/conn.py, MooncakeKVManager
    # .send_kvcache) moves kv_bytes_per_token for every prompt token to the decode.
    transfer_overhead_ms: float
    transfer_ms_per_token: float

    def prefill_batch_ms(self, chunks: Iterable[tuple[int, int]]) -> float:
        """One extend batch; `chunks` are (new tokens, tokens already cached) per request."""
        new_total = cached_total = 0
        pairs_new = pairs_cached = 0.0
        for new, cached in chunks:
            new_total += new
            cached_total += cached
            pairs_new += new * new / 2
            pairs_cached += new * cached
        if new_total <= 0:
            return 0.0
        compute = (self.prefill_overhead_ms + self.prefill_ms_per_token * new_total
                   + self.prefill_ms_per_mpair_new * pairs_new / 1e6
                   + self.prefill_ms_per_mpair_cached * pairs_cached / 1e6)
        floor = self.prefill_floor_ms + self.prefill_floor_ms_per_cached_token * cached_total
        return max(floor, compute)

    def prefill_ms(self, new: int, cached: int = 0) -> float:
        """One request of `new` uncached tokens after `cached` ones, alone in its batch."""
        return self.prefill_batch_ms([(new, cached)])

    def prefill_chunked_ms(self, new: int, cached: int = 0, chunk: int = 8192) -> float:
        """A prompt prefilled in --chunked-prefill-size pieces, each after the ones before."""
        total, done = 0.0, 0
        while done < new:
            take = min(chunk, new - done)
            total += self.prefill_ms(take, cached + done)
            done += take
        return total

    def decode_ms(self, batch: int, context_tokens: int) -> float:
        """One decode step of `batch` requests holding `context_tokens` KV tokens in all."""
        if batch <= 0:
            return 0.0
        return (self.decode_step_ms + self.decode_ms_per_req * batch
                + self.decode_ms_per_kv_token * context_tokens)

    def transfer_ms(self, prompt_tokens: int) -> float:
        """The KV of a whole prompt from a prefill to its decode."""
        return self.transfer_overhead_ms + self.transfer_ms_per_token * prompt_tokens

    def knobs(self) -> dict[str, float]:
        """The coefficients by their SimConfig/flag names."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("name", "source", "kv_bytes_per_token")}


# Fitted by loadtests/calibration/fit.py from loadtests/calibration/h200_llama3_8b.json
# (loadtests/gpu_calibrate.py, a Llama-3-8B shape in bf16 on one H200, torch 2.11 SDPA,
# decode from CUDA graphs). Max relative error over the table: prefill 6.6% (21 points:
# new 256-16k x cached 0/2k/8k), decode 2.6% (24 points: batch 1-256 x context 512-8k).
# Transfer: 128 KiB per token at the 54.8 GB/s the same run measured for a device-to-pinned-host
# copy, standing in for one 400 Gb/s RDMA NIC.
H200_LLAMA3_8B = TimingProfile(
    name="h200-llama3-8b",
    source="loadtests/calibration/h200_llama3_8b.json",
    kv_bytes_per_token=131072,
    prefill_overhead_ms=2.185,
    prefill_ms_per_token=0.025684,
    prefill_ms_per_mpair_new=1.1446,
    prefill_ms_per_mpair_cached=1.6192,
    prefill_floor_ms=20.008,
    prefill_floor_ms_per_cached_token=0.00090221,
    decode_step_ms=5.8517,
    decode_ms_per_req=0.012079,
    decode_ms_per_kv_token=0.000028159,
    transfer_overhead_ms=1.0,
    transfer_ms_per_token=0.0024,
)

# The earlier estimate for an 8B model on one H100 (no attention or floor terms); kept so a
# run can be compared with results taken before the calibration.
H100_8B_ESTIMATE = TimingProfile(
    name="h100-8b-estimate",
    source="estimate (docs/SIMULATOR.md)",
    kv_bytes_per_token=131072,
    prefill_overhead_ms=5.0,
    prefill_ms_per_token=0.05,
    prefill_ms_per_mpair_new=0.0,
    prefill_ms_per_mpair_cached=0.0,
    prefill_floor_ms=0.0,
    prefill_floor_ms_per_cached_token=0.0,
    decode_step_ms=7.0,
    decode_ms_per_req=0.07,
    decode_ms_per_kv_token=0.00004,
    transfer_overhead_ms=1.0,
    transfer_ms_per_token=0.003,
)

# The same fit on loadtests/calibration/h200_qwen25_32b.json (the same run, a smaller grid:
# 8 prefill points, new 256-16k x cached 0/8k; 6 decode points, batch 1-128 x context 1k/4k).
# Max relative error: prefill 2.3%, decode 0.7%. Transfer: 256 KiB per token at 54.8 GB/s.
H200_QWEN25_32B = TimingProfile(
    name="h200-qwen2.5-32b",
    source="loadtests/calibration/h200_qwen25_32b.json",
    kv_bytes_per_token=262144,
    prefill_overhead_ms=8.5671,
    prefill_ms_per_token=0.10479,
    prefill_ms_per_mpair_new=2.9982,
    prefill_ms_per_mpair_cached=4.4364,
    prefill_floor_ms=41.384,
    prefill_floor_ms_per_cached_token=0.00037537,
    decode_step_ms=19.532,
    decode_ms_per_req=0.03049,
    decode_ms_per_kv_token=0.000056069,
    transfer_overhead_ms=1.0,
    transfer_ms_per_token=0.0048,
)

PROFILES: dict[str, TimingProfile] = {
    p.name: p for p in (H200_LLAMA3_8B, H200_QWEN25_32B, H100_8B_ESTIMATE)}
# The calibrated profile: what benchmarks (loadtests/goodput) run unless told otherwise.
DEFAULT_PROFILE = H200_LLAMA3_8B
# The simulator's own flag default stays the earlier estimate: tests/reliability/
# test_overload.py's burst past capacity is tuned to it (with the calibrated profile its
# "0 retries" failed 5 runs of 8) and loadtests/routing/replay.py copies its prefill formula.
SIM_DEFAULT_PROFILE = H100_8B_ESTIMATE
KNOBS: tuple[str, ...] = tuple(DEFAULT_PROFILE.knobs())

# --flag help for each knob (config.py builds the flags from this table).
KNOB_HELP: dict[str, str] = {
    "prefill_overhead_ms": "fixed compute cost of one prefill batch",
    "prefill_ms_per_token": "prefill cost per uncached prompt token",
    "prefill_ms_per_mpair_new": "prefill attention per million causal pairs among new tokens",
    "prefill_ms_per_mpair_cached": "prefill attention per million (new, cached) token pairs",
    "prefill_floor_ms": "least time of a prefill batch (launch-bound)",
    "prefill_floor_ms_per_cached_token": "floor growth per cached prefix token in the batch",
    "decode_step_ms": "fixed cost of one decode step",
    "decode_ms_per_req": "decode step cost per running request",
    "decode_ms_per_kv_token": "decode step cost per context token in the batch",
    "transfer_overhead_ms": "fixed cost of one KV transfer (prefill)",
    "transfer_ms_per_token": "KV transfer cost per prompt token",
}


def with_knobs(base: TimingProfile, values: dict[str, float]) -> TimingProfile:
    """`base` with some coefficients replaced (the flags that were given)."""
    return dataclasses.replace(base, **values)
