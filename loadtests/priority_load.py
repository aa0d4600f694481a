"""The two clients of the priority scenario: a steady interactive tenant and a batch flood.

* interactive: Poisson arrivals at `rate` per second, seeded, so every target gets the same
  schedule; each request is streamed on its own connection, and its TTFT and latency count
  from the SCHEDULED send time: a stalled proxy cannot slow the sender down and so hide its
  own queueing (no coordinated omission).
* flood: `flood` clients sending back to back as batch work. A refused request (429, 503;
  sglang-router's 408) is sent again after `backoff` seconds, not after its Retry-After: the
  flood is meant to keep the proxy's queue full for the whole window, as a misbehaving batch
  job would. Its answer lengths vary (`spread`, seeded per client), as batch jobs' do: with
  identical lengths the requests that start in one decode step all end in one step, slots
  free up in bursts a whole request apart, and any waiter's wait is set by that lockstep (an
  artefact of identical requests, not of the scheduling under test).

Only requests sent inside the measured window count. The flood starts `warmup` seconds
earlier, so the queue is full when the window opens; nothing new starts after the window,
and what is in flight then is awaited (each request bounded by `timeout`).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

from loadtests.routing.client import Reply, stream

PATH = "/generate"
# refused by admission: queue full, shed, or no slot in time (sglang-router: 408)
SHED = (408, 429, 503)


@dataclass(frozen=True)
class Client:
    """One tenant's traffic: its label in the table, API key and priority class."""

    tenant: str
    key: str
    priority: str

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.key}", "x-priority": self.priority}


@dataclass(frozen=True)
class Load:
    """What one target is driven with."""

    port: int
    tokens: int  # max_new_tokens of every request
    rate: float  # interactive requests per second
    flood: int  # batch clients; 0: the interactive tenant alone
    warmup: float
    duration: float
    backoff: float
    timeout: float
    seed: int
    spread: float = 0.0  # flood lengths uniform in tokens x [1 - spread, 1 + spread]


def body(client: Client, index: int, tokens: int) -> dict:
    """A short streamed /generate request, its text distinct per request."""
    return {"text": f"{client.tenant} request {index}: summarise the storm log.",
            "stream": True, "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}}


def arrivals(rate: float, duration: float, seed: int) -> list[float]:
    """Offsets in [0, duration) of a Poisson process of `rate` per second."""
    rng = random.Random(seed)
    out, t = [], rng.expovariate(rate)
    while t < duration:
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def _timed(load: Load, client: Client, index: int, scheduled: float,
                 tokens: int) -> Reply:
    """One request, its times counted from `scheduled` (perf_counter)."""
    lag = time.perf_counter() - scheduled
    reply = await stream(load.port, PATH, body(client, index, tokens), load.timeout,
                         client.headers)
    reply.latency += lag
    if reply.ttft is not None:
        reply.ttft += lag
    return reply


async def _interactive(load: Load, client: Client, start: float) -> list[Reply]:
    async def one(index: int, offset: float) -> Reply:
        scheduled = start + offset
        delay = scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        return await _timed(load, client, index, scheduled, load.tokens)

    offsets = arrivals(load.rate, load.duration, load.seed)
    return list(await asyncio.gather(*(one(i, at) for i, at in enumerate(offsets))))


async def _flood(load: Load, client: Client, start: float, server: int) -> list[Reply]:
    """One batch client: back to back until the window ends; only the window's count."""
    counted: list[Reply] = []
    end = start + load.duration
    rng = random.Random(load.seed * 7919 + server)
    low = max(1, round(load.tokens * (1 - load.spread)))
    high = max(low, round(load.tokens * (1 + load.spread)))
    index = 0
    while (sent := time.perf_counter()) < end:
        reply = await _timed(load, client, server * 1_000_000 + index, sent,
                             rng.randint(low, high))
        index += 1
        if sent >= start:
            counted.append(reply)
        if not reply.ok:
            await asyncio.sleep(load.backoff if reply.status in SHED else 0.05)
    return counted


async def drive(load: Load, interactive: Client, batch: Client) -> dict[str, list[Reply]]:
    """Every counted reply per tenant: the flood (if any) from `warmup` seconds before the
    window, the interactive tenant inside it."""
    start = time.perf_counter() + (load.warmup if load.flood else 0.05)
    floods = [asyncio.create_task(_flood(load, batch, start, w)) for w in range(load.flood)]
    try:
        await asyncio.sleep(max(0.0, start - time.perf_counter()))
        replies = await _interactive(load, interactive, start)
        batch_replies = [r for done in await asyncio.gather(*floods) for r in done]
    finally:
        for task in floods:
            task.cancel()
    out = {interactive.tenant: replies}
    if load.flood:
        out[batch.tenant] = batch_replies
    return out
