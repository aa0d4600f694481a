"""The GPU physics the latency model starts from, before a server has taught it anything.

Fitted to one device run of a Llama-3-8B shape (random bf16 weights, torch SDPA, one H200;
issue 24's cross-check), in seconds:

    prefill(new, cached) = 7.44e-3 + 1.79e-5 * new + 1.15e-9 * new * (cached + new / 2)
        (21.6 ms for 1k new tokens, 92 ms for 4k, 455 ms for 16k; 17.9 ms for 256 new
        after 8k cached: a fixed cost per step, a cost per token, and attention, which grows
        with every token each new token attends to)
    decode_step(batch, context) = 4.16e-3 + 7.1e-6 * batch + 3.0e-8 * context
        (4.2 ms at batch 1, 9.0 ms at batch 128 with 1k context each, 37.4 ms at batch 256
        with 4k each; `context` is the KV tokens of the whole batch)
    transfer(tokens) = 1e-3 + tokens * 128 KiB / 40 GB/s
        (128 KiB of KV per token; 40 GB/s is a 400 Gb/s RDMA link, a setup of one step)

A server's measured figures replace the prior where it reports them (`/v1/loads` prefill
speed) and the gateway's own observations correct the rest (gateway/slo/model.py), so the
prior only has to be the right shape, not the right device.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Physics:
    """Coefficients of the prior (seconds, tokens, bytes)."""

    prefill_fixed: float = 7.44e-3
    prefill_per_token: float = 1.79e-5
    prefill_attention: float = 1.15e-9  # per new token per token it attends to
    decode_fixed: float = 4.16e-3
    decode_per_request: float = 7.1e-6
    decode_per_context_token: float = 3.0e-8
    kv_bytes_per_token: int = 128 * 1024
    link_bytes_per_second: float = 40e9
    transfer_fixed: float = 1e-3

    @property
    def prefill_tokens_per_second(self) -> float:
        """The prior's speed on the linear part (what `/v1/loads` speed replaces)."""
        return 1.0 / self.prefill_per_token

    def prefill(self, new: float, cached: float = 0.0) -> float:
        """Seconds to prefill `new` tokens after `cached` ones, alone on the server."""
        if new <= 0:
            return 0.0
        return (self.prefill_fixed + self.prefill_per_token * new
                + self.prefill_attention * new * (cached + new / 2))

    def attention(self, new: float, cached: float = 0.0) -> float:
        """The attention part of `prefill` (it grows with the context, unlike the rest)."""
        return self.prefill_attention * new * (cached + new / 2) if new > 0 else 0.0

    def decode_step(self, batch: float, context: float) -> float:
        """Seconds of one decode step of `batch` requests holding `context` KV tokens."""
        return (self.decode_fixed + self.decode_per_request * batch
                + self.decode_per_context_token * context)

    def transfer(self, tokens: float) -> float:
        """Seconds to move the KV of `tokens` prompt tokens from prefill to decode."""
        return self.transfer_fixed + tokens * self.kv_bytes_per_token / self.link_bytes_per_second


H200_LLAMA3_8B = Physics()
