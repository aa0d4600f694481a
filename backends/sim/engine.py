"""The simulated GPU: one scheduler loop with a FIFO queue and a timing model.

Each loop turn runs one chunked-prefill batch (if any request is admitted and
not yet prefilled), then one decode step for every decoding request, and
sleeps for the modeled duration of each (minus the Python time already spent):

    prefill batch = prefill_overhead_ms + prefill_ms_per_token * uncached tokens
    decode step   = decode_step_ms + decode_ms_per_req * batch
                    + decode_ms_per_kv_token * context tokens in the batch
                    (or a fixed --token-delay)

Admission is FIFO, bounded by --max-running-requests and the KV pool size.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

from backends.sim.config import SimConfig
from backends.sim.job import Job
from backends.sim.radix import RadixCache

_THROUGHPUT_WINDOW = 5.0
_HIT_WINDOW = 64


class Engine:
    """Owns the queues, the prefix cache and the token counters."""

    def __init__(self, config: SimConfig, cache: RadixCache) -> None:
        self.config = config
        self.cache = cache
        self.waiting: deque[Job] = deque()
        self.prefilling: list[Job] = []
        self.decoding: list[Job] = []
        self.inflight: set[Job] = set()  # prefill mode: prefilled, KV being sent
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.cached_tokens_total = 0
        self.requests_total = 0
        self._hits: deque[tuple[int, int]] = deque(maxlen=_HIT_WINDOW)
        self._gen_marks: deque[tuple[float, int]] = deque()

    # ---- lifecycle -------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    # ---- entry points used by the flows ----------------------------------
    def submit_prefill(self, job: Job) -> None:
        """Queue a job for prefill; `job.prefilled` fires when its first token exists."""
        job.phase = "waiting"
        job.cached_tokens = self.cache.match(job.spec.input_ids)
        self.waiting.append(job)
        self._wake.set()

    def submit_decode(self, job: Job) -> None:
        """Continue a job whose KV and first token came from a prefill server."""
        self.requests_total += 1
        self.prompt_tokens_total += job.prompt_tokens
        self.cached_tokens_total += job.cached_tokens
        self._count_generated(len(job.output_ids))
        if job.done:
            return
        job.phase = "waiting"
        self.waiting.append(job)
        self._wake.set()

    def release(self, job: Job) -> None:
        """Prefill mode: the KV of `job` left the server; free its slot."""
        self.inflight.discard(job)
        self._wake.set()

    def drop(self, job: Job) -> None:
        """Forget a cancelled, aborted or failed job wherever it is."""
        for queue in (self.prefilling, self.decoding):
            if job in queue:
                queue.remove(job)
        if job in self.waiting:
            self.waiting.remove(job)
        self.inflight.discard(job)
        self._wake.set()

    # ---- load figures ----------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.prefilling) + len(self.decoding) + len(self.inflight)

    @property
    def num_used_tokens(self) -> int:
        running = (*self.prefilling, *self.decoding, *self.inflight)
        return sum(j.context_len for j in running)

    @property
    def waiting_uncached_tokens(self) -> int:
        return sum(max(0, j.prompt_tokens - j.cached_tokens) for j in self.waiting)

    @property
    def cache_hit_rate(self) -> float:
        total = sum(p for p, _ in self._hits)
        return sum(c for _, c in self._hits) / total if total else 0.0

    @property
    def gen_throughput(self) -> float:
        self._trim_marks(time.monotonic())
        return sum(n for _, n in self._gen_marks) / _THROUGHPUT_WINDOW

    def _trim_marks(self, now: float) -> None:
        while self._gen_marks and self._gen_marks[0][0] < now - _THROUGHPUT_WINDOW:
            self._gen_marks.popleft()

    # ---- the loop --------------------------------------------------------
    async def _run(self) -> None:
        while True:
            self._admit()
            if not self.prefilling and not self.decoding:
                self._wake.clear()
                await self._wake.wait()
                continue
            if self.prefilling:
                await self._prefill_step()
            if self.decoding:
                await self._decode_step()

    def _admit(self) -> None:
        limit = self.config.max_running_requests
        while self.waiting and self.num_running < limit:
            job = self.waiting[0]
            need = job.context_len + max(0, job.spec.max_new_tokens - len(job.output_ids))
            if self.num_running and self.num_used_tokens + need > self.config.max_total_tokens:
                return
            self.waiting.popleft()
            if job.output_ids:  # decode mode: KV already here
                job.phase = "decoding"
                self.decoding.append(job)
                continue
            job.cached_tokens = self.cache.match(job.spec.input_ids)
            job.remaining_prefill = job.prompt_tokens - job.cached_tokens
            job.phase = "prefill"
            self.prefilling.append(job)

    async def _prefill_step(self) -> None:
        started = time.perf_counter()
        budget = self.config.chunked_prefill_size
        tokens = 0
        for job in self.prefilling:
            if budget <= 0:
                break
            take = min(job.remaining_prefill, budget)
            job.remaining_prefill -= take
            budget -= take
            tokens += take
        cfg = self.config
        await _spend(started, (cfg.prefill_overhead_ms + cfg.prefill_ms_per_token * tokens) / 1e3)
        for job in [j for j in self.prefilling if j.remaining_prefill <= 0]:
            self.prefilling.remove(job)
            if job.done:
                continue
            self._prefill_done(job)

    def _prefill_done(self, job: Job) -> None:
        self.requests_total += 1
        self.prompt_tokens_total += job.prompt_tokens
        self.cached_tokens_total += job.cached_tokens
        self._hits.append((job.prompt_tokens, job.cached_tokens))
        self.cache.insert(job.spec.input_ids)
        mode = self.config.mode
        if mode == "prefill":
            job.stage_first_token()
            self._count_generated(1)
            job.prefilled.set()
            self.inflight.add(job)
            return
        if job.spec.max_new_tokens <= 0:
            job.finish({"type": "length", "length": 0})
        else:
            job.next_token()
            self._count_generated(1)
        job.prefilled.set()
        if job.done:
            self._cache_finished(job)
        else:
            job.phase = "decoding"
            self.decoding.append(job)

    async def _decode_step(self) -> None:
        started = time.perf_counter()
        cfg = self.config
        batch = list(self.decoding)
        if cfg.token_delay is not None:
            seconds = cfg.token_delay
        else:
            kv = sum(j.context_len for j in batch)
            seconds = (cfg.decode_step_ms + cfg.decode_ms_per_req * len(batch)
                       + cfg.decode_ms_per_kv_token * kv) / 1e3
        await _spend(started, seconds)
        produced = 0
        for job in batch:
            if job.done:
                continue
            job.next_token()
            produced += 1
        self._count_generated(produced)
        finished = [j for j in self.decoding if j.done]
        for job in finished:
            self.decoding.remove(job)
            if job.error is None and not job.cancelled:
                self._cache_finished(job)

    def _cache_finished(self, job: Job) -> None:
        """A plain server caches prompt + output (all but the last token)."""
        if self.config.mode == "null" and len(job.output_ids) > 1:
            self.cache.insert(job.spec.input_ids + job.output_ids[:-1])

    def _count_generated(self, n: int) -> None:
        if n:
            self.generation_tokens_total += n
            now = time.monotonic()
            self._gen_marks.append((now, n))
            self._trim_marks(now)


async def _spend(started: float, seconds: float) -> None:
    """Sleep until `seconds` after `started`; always yields to the loop."""
    await asyncio.sleep(max(0.0, seconds - (time.perf_counter() - started)))
