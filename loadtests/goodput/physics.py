"""The servers' timing physics, one description for the simulated servers and for the DES.

`Physics` names the simulator's timing profile (`backends/sim/timing.py`, default the H200
Llama-3-8B calibration) and the KV pool, gives the `backends.sim` flags every server of the
benchmark starts with, and resolves those same flags with the simulator's own parser
(`SimConfig`) into the `TimingProfile` the servers compute with. So the capacity bound of
`capacity.py` uses the very figures the servers do: prefill batch time from each request's
new and already-cached tokens, decode step time from the batch and its context, KV transfer
time from the prompt, the KV pool, the running-request limit and the chunked-prefill budget.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from backends.sim.config import SimConfig, config_from_args
from backends.sim.timing import DEFAULT_PROFILE, KNOBS, PROFILES, TimingProfile, with_knobs


@dataclass(frozen=True)
class Physics:
    """Timing and sizes shared by the servers and the DES."""

    kv_tokens: int = 131072  # KV pool of every server; a prefill's prefix cache is its pool
    cache_tokens: int = 0  # a prefill's prefix cache when smaller than its pool (0: the pool)
    timing: str = DEFAULT_PROFILE.name  # a name in backends.sim.timing.PROFILES
    config: SimConfig = field(init=False, compare=False, repr=False)
    profile: TimingProfile = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.timing not in PROFILES:
            raise ValueError(f"unknown timing profile {self.timing!r}; known: {list(PROFILES)}")
        config = config_from_args(["--mode", "prefill", *self.sim_flags()])
        knobs = {k: getattr(config, k) for k in KNOBS}  # what the server resolved
        object.__setattr__(self, "config", config)
        object.__setattr__(self, "profile", with_knobs(PROFILES[config.timing], knobs))

    def sim_flags(self) -> tuple[str, ...]:
        """What every server is started with (after the cluster's own flags, so these win)."""
        return ("--timing", self.timing, "--max-total-tokens", str(self.kv_tokens),
                # SGLang's own 300 s: a request waiting long in an overloaded queue is still a
                # queued one, which the servers must not give up on before the routers do
                "--bootstrap-timeout", "300", "--waiting-timeout", "300")

    @property
    def prefix_cache_tokens(self) -> int:
        """What a prefill keeps of earlier prompts (the sims' `--cache-capacity-tokens`)."""
        return min(self.cache_tokens or self.kv_tokens, self.kv_tokens)

    @property
    def chunk(self) -> int:
        return self.config.chunked_prefill_size

    @property
    def max_running(self) -> int:
        return self.config.max_running_requests

    def prefill_batch_ms(self, chunks: Iterable[tuple[int, int]]) -> float:
        """One extend batch of (new tokens, tokens already in the pool) per request."""
        return self.profile.prefill_batch_ms(chunks)

    def prefill_ms(self, new: int, cached: int = 0) -> float:
        """A prompt's `new` tokens after `cached` ones, alone, in chunked-prefill pieces."""
        return self.profile.prefill_chunked_ms(new, cached, self.chunk)

    def decode_step_ms(self, batch: int, context: int) -> float:
        """One decode step of `batch` requests holding `context` KV tokens in all."""
        if self.config.token_delay is not None:
            return self.config.token_delay * 1e3
        return self.profile.decode_ms(batch, context)

    def transfer_ms(self, prompt_tokens: int) -> float:
        """The KV of a prompt from its prefill to its decode."""
        return self.profile.transfer_ms(prompt_tokens)
