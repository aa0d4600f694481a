"""The cluster's capacity bound: a discrete-event simulation of the same servers, in-process.

The DES replays a plan on P prefill and D decode servers that follow the simulator's scheduler
(`backends/sim/engine.py`) with the benchmark's `Physics`: a prefill server admits its FIFO
queue (up to `max_running_requests`), matches each prompt against its own prefix cache (the
simulator's `RadixCache`, LRU, the KV pool's size) at admission, computes chunked-prefill
steps of `chunked_prefill_size` tokens, caches the prompt, and sends the KV (transfer time);
the first token reaches the client when the request joins its decode's batch (SGLang's decode
streams it in `process_batch_result_prebuilt`; the simulator's `engine._join_decode`). A decode
server admits within its KV pool and runs continuous-batching steps, one token per request per
step. No network, no proxy, no HTTP.

Placement sees everything a router could wish for: the exact state of every server at each
arrival (queues, caches, batches), with no staleness. Two placements, and a rate counts as
served when either meets the objectives for it (`PLACEMENTS`):

* `earliest`: each request goes to the prefill that finishes it first (queued uncached work
  ahead + its own uncached tokens on that server's cache + transfer). Myopic: near capacity
  it puts a long document on whichever server is free now, evicting others' prefixes.
* `affinity`: the prefill holding the longest cached prefix of the prompt, unless its finish
  would spend more than half the request's TTFT objective; then the earliest. It keeps the
  working set partitioned and spreads a hot prefix only when its server queues.

Each request goes to the decode with the least KV in use or waiting. A request that no
prefill can serve within its TTFT objective is refused at arrival (it counts as missed and
costs no work), as Conductor's early rejection does. These are strong offline placements, not
a proven optimum (a router may beat them: then the bound is a reference, and the docs say
so); the bound is the rate at which the better of them first fails to meet the objectives
for >= 90% of the requests, scanning upward, as the routers' goodput is read
(`capacity_rate`: a scan in 10% steps, then bisection).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from backends.sim.radix import RadixCache
from loadtests.goodput.physics import Physics
from loadtests.goodput.workload import MixShape, Plan, Planned, mixed_plan, warmup_plan

TARGET = 0.9  # attainment that counts as serving a rate
PLACEMENTS = ("earliest", "affinity")


@dataclass(eq=False)
class _Job:
    req: Planned
    ids: list[int]
    cached: int = 0
    remaining: int = 0  # uncached prompt tokens still to compute
    kv_at: float | None = None  # when its KV reached the decode (seconds from the start)
    first: float | None = None  # seconds from the run's start
    last: float | None = None
    tokens: int = 0  # generated so far (the first came with the KV)
    refused: bool = False

    @property
    def context(self) -> int:
        return len(self.ids) + self.tokens


class _Clock:
    """The event queue: callbacks at simulated times, in order (ties: first scheduled)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def at(self, when: float, call: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (when, next(self._seq), call))

    def run(self) -> None:
        while self._heap:
            self.now, _, call = heapq.heappop(self._heap)
            call()


class _Decode:
    def __init__(self, clock: _Clock, physics: Physics) -> None:
        self.clock, self.physics = clock, physics
        self.waiting: deque[_Job] = deque()
        self.decoding: list[_Job] = []
        self.busy = False

    @property
    def load(self) -> int:
        """KV tokens held or about to be: what the placement balances."""
        return sum(j.context for j in self.decoding) + sum(j.context for j in self.waiting)

    def submit(self, job: _Job) -> None:
        """The KV (and the prefill's first token) arrived; the client sees that token when
        the request joins the batch (`_turn`), as SGLang's decode streams it then."""
        job.tokens, job.kv_at = 1, self.clock.now
        self.waiting.append(job)
        if not self.busy:
            self.busy = True
            self._turn()

    def _turn(self) -> None:
        running = len(self.decoding)
        used = sum(j.context for j in self.decoding)
        while self.waiting and running < self.physics.max_running:
            job = self.waiting[0]
            need = job.context + job.req.max_tokens - job.tokens
            if running and used + need > self.physics.kv_tokens:
                break
            self.waiting.popleft()
            job.first = job.last = self.clock.now
            if job.req.max_tokens <= 1:
                continue  # done with the prefill's token
            self.decoding.append(job)
            running += 1
            used += job.context
        if not self.decoding:
            self.busy = False
            return
        batch = list(self.decoding)
        step = self.physics.decode_step_ms(len(batch), used) / 1e3
        self.clock.at(self.clock.now + step, lambda: self._end(batch))

    def _end(self, batch: list[_Job]) -> None:
        now = self.clock.now
        for job in batch:
            job.tokens += 1
            job.last = now
        self.decoding = [j for j in self.decoding if j.tokens < j.req.max_tokens]
        self._turn()


class _Prefill:
    def __init__(self, clock: _Clock, physics: Physics) -> None:
        self.clock, self.physics = clock, physics
        self.cache = RadixCache(1, physics.prefix_cache_tokens)
        self.waiting: deque[tuple[_Job, _Decode]] = deque()
        self.prefilling: list[tuple[_Job, _Decode]] = []
        self.busy = False
        self.busy_until = 0.0

    def finish_estimate(self, ids: list[int], cached: int | None = None) -> float:
        """When a prompt sent now would have its KV at a decode: the queue ahead and this
        prompt cut into chunked-prefill batches in FIFO order, after the running step."""
        cached = self.cache.match(ids) if cached is None else cached
        queue = [(j.remaining, len(j.ids) - j.remaining)
                 for j, _ in (*self.prefilling, *self.waiting)]
        queue.append((len(ids) - cached, cached))
        start = max(self.clock.now, self.busy_until)
        return start + (self._drain_ms(queue) + self.physics.transfer_ms(len(ids))) / 1e3

    def _drain_ms(self, queue: list[tuple[int, int]]) -> float:
        total, batch, budget = 0.0, [], self.physics.chunk
        for new, cached in queue:
            while new > 0:
                take = min(new, budget)
                batch.append((take, cached))
                new, cached, budget = new - take, cached + take, budget - take
                if budget == 0:
                    total += self.physics.prefill_batch_ms(batch)
                    batch, budget = [], self.physics.chunk
        return total + (self.physics.prefill_batch_ms(batch) if batch else 0.0)

    def submit(self, job: _Job, decode: _Decode) -> None:
        job.remaining = len(job.ids) - self.cache.match(job.ids)
        self.waiting.append((job, decode))
        if not self.busy:
            self._step()

    def _step(self) -> None:
        """Admit (matching the cache now), then one chunked-prefill batch (engine.py)."""
        used = sum(len(j.ids) for j, _ in self.prefilling)
        while self.waiting and len(self.prefilling) < self.physics.max_running:
            job, decode = self.waiting[0]
            need = len(job.ids) + job.req.max_tokens
            if self.prefilling and used + need > self.physics.kv_tokens:
                break
            self.waiting.popleft()
            used += len(job.ids)
            job.cached = self.cache.match(job.ids)
            job.remaining = len(job.ids) - job.cached
            self.prefilling.append((job, decode))
        self.busy = bool(self.prefilling)
        if not self.busy:
            return
        budget, chunks = self.physics.chunk, []
        for job, _ in self.prefilling:
            if budget <= 0:
                break
            take = min(job.remaining, budget)
            chunks.append((take, len(job.ids) - job.remaining))
            job.remaining -= take
            budget -= take
        self.busy_until = self.clock.now + self.physics.prefill_batch_ms(chunks) / 1e3
        self.clock.at(self.busy_until, self._end)

    def _end(self) -> None:
        done = [(j, d) for j, d in self.prefilling if j.remaining <= 0]
        self.prefilling = [(j, d) for j, d in self.prefilling if j.remaining > 0]
        for job, decode in done:
            self.cache.insert(job.ids)
            delay = self.physics.transfer_ms(len(job.ids)) / 1e3
            self.clock.at(self.clock.now + delay, lambda j=job, d=decode: d.submit(j))
        self._step()


@dataclass(frozen=True)
class DesResult:
    rate: float
    requests: int
    attained: int
    refused: int
    placement: str = PLACEMENTS[0]

    @property
    def attainment(self) -> float:
        return self.attained / self.requests if self.requests else 1.0


def latency(job: _Job) -> tuple[float, float] | None:
    """(TTFT, mean ITL) in ms as the client would have seen them; None: refused or unserved."""
    if job.refused or job.first is None:
        return None
    gaps = job.tokens - 1
    itl_ms = ((job.last or job.first) - job.first) * 1e3 / gaps if gaps > 0 else 0.0
    return (job.first - job.req.at) * 1e3, itl_ms


def met(job: _Job) -> bool:
    seen = latency(job)
    return seen is not None and seen[0] <= job.req.ttft_ms and seen[1] <= job.req.itl_ms


DRAIN = 2.0  # seconds between a warm-up's last arrival and the measured plan's first


def _after(warmup: Plan | None, plan: Plan) -> tuple[Plan, int]:
    """`plan` behind `warmup` (its arrivals shifted past the warm-up's and a drain), and
    how many requests lead it: the DES warms its caches as the routers' runs do."""
    if warmup is None:
        return plan, 0
    offset = warmup.duration + DRAIN
    shifted = tuple(replace(r, at=r.at + offset) for r in plan.requests)
    return replace(plan, requests=warmup.requests + shifted), len(warmup.requests)


def simulate(plan: Plan, prefills: int, decodes: int, physics: Physics,
             warmup: Plan | None = None) -> DesResult:
    """Replay `plan` (after `warmup`, not counted) with each placement; the one that
    attains most is the result."""
    joined, lead = _after(warmup, plan)
    results = []
    for placement in PLACEMENTS:
        jobs = replay(joined, prefills, decodes, physics, placement)[lead:]
        results.append(DesResult(plan.rate, len(jobs), sum(met(j) for j in jobs),
                                 sum(j.refused for j in jobs), placement))
    return max(results, key=lambda r: r.attained)


def _choose(ps: list[_Prefill], job: _Job, placement: str) -> tuple[float, int]:
    """(when its KV reaches a decode, which prefill) under `placement`."""
    cached = [p.cache.match(job.ids) for p in ps]
    finish = [(p.finish_estimate(job.ids, c), i) for i, (p, c) in enumerate(zip(ps, cached, strict=True))]
    earliest = min(finish)
    if placement == "earliest":
        return earliest
    home = max(range(len(ps)), key=lambda i: (cached[i], -finish[i][0]))
    within = (finish[home][0] - job.req.at) * 1e3 <= job.req.ttft_ms / 2
    return finish[home] if within else earliest


def replay(plan: Plan, prefills: int, decodes: int, physics: Physics,
           placement: str = PLACEMENTS[0]) -> list[_Job]:
    """Every request of `plan` as the DES served it under `placement`."""
    clock = _Clock()
    ps = [_Prefill(clock, physics) for _ in range(prefills)]
    ds = [_Decode(clock, physics) for _ in range(decodes)]
    jobs = [_Job(req, req.prompt_ids()) for req in plan.requests]

    def arrive(job: _Job) -> None:
        when, best = _choose(ps, job, placement)
        if (when - job.req.at) * 1e3 > job.req.ttft_ms:
            job.refused = True
            return
        decode = min(ds, key=lambda d: d.load)
        ps[best].submit(job, decode)

    for job in jobs:
        clock.at(job.req.at, lambda j=job: arrive(j))
    clock.run()
    return jobs


SCAN = 1.1  # the upward scan's ratio from one rate to the next


def capacity_rate(shape: MixShape, duration: float, seed: int, prefills: int, decodes: int,
                  physics: Physics, start: float = 10.0, precision: float = 0.03,
                  log: Callable[[str], None] = print,
                  warmup: float = 0.0) -> tuple[float, list[DesResult]]:
    """Where the DES's attainment first falls below 90%, by the routers' goodput rule
    (`report.goodput`: the first crossing from below): scan upward from `start` in steps of
    `SCAN` (halving first if `start` already fails) to the first failing rate, then bisect
    between it and the rate before to `precision` (relative).

    Not "double until a rate fails": on one plan per rate the attainment is not monotonic
    in the rate (the 32B calibration, seed 0, 20 s: 0.92 at 26, 0.87 at 28, 0.93 at 34, 0.92
    at 40), and doubling from 10 tested 20 and 40 and reported 40, a rate above a crossing
    that no router's goodput could ever count past."""
    tried: list[DesResult] = []

    def ok(rate: float) -> bool:
        result = simulate(mixed_plan(shape, rate, duration, seed), prefills, decodes, physics,
                          warmup_plan(shape, rate, warmup, seed))
        tried.append(result)
        log(f"   capacity DES: {rate:7.2f} req/s -> attainment {result.attainment:.3f} "
            f"({result.refused} refused of {result.requests}; {result.placement})")
        return result.attainment >= TARGET

    low = start
    while not ok(low):
        low /= 2
        if low < 0.5:
            return 0.0, sorted(tried, key=lambda r: r.rate)
    high = low * SCAN
    while ok(high):
        low, high = high, high * SCAN
        if high > 1e5:
            raise RuntimeError("the DES serves any rate: check the physics")
    while high - low > precision * low:
        middle = (low + high) / 2
        if ok(middle):
            low = middle
        else:
            high = middle
    return low, sorted(tried, key=lambda r: r.rate)
