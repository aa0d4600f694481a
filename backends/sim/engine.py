"""The simulated GPU: one scheduler with a FIFO queue and a timing model.

Each scheduler turn runs one chunked-prefill batch (if any request is
admitted and not yet prefilled), then one decode step for every decoding
request; each takes its modeled duration:

    prefill batch = TimingProfile.prefill_batch_ms over each request's (tokens extended in
                    this batch, tokens whose KV was there before them)
    decode step   = TimingProfile.decode_ms(batch, context tokens in the batch)
                    (or a fixed --token-delay)

with the profile of --timing and the knob flags (backends/sim/timing.py, fitted to the GPU
table in loadtests/calibration/).

Admission is FIFO, bounded by --max-running-requests and the KV pool size.

The scheduler is driven by loop callbacks, not a task: `submit()` schedules
a turn with `call_soon` (so every request that arrived in the same loop
iteration joins the same batch), a modeled duration is a `call_at` that ends
the step, and a zero duration (--fast) ends it in the next callback. A busy
--fast server thus costs a callback per step, shared by the whole batch, and
adds no timer, sleep or Event.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from backends.sim.config import SimConfig
from backends.sim.job import Job
from backends.sim.radix import RadixCache
from backends.sim.timing import KNOBS, PROFILES, with_knobs

_THROUGHPUT_WINDOW = 5.0
_HIT_WINDOW = 64


class Engine:
    """Owns the queues, the prefix cache and the token counters."""

    def __init__(self, config: SimConfig, cache: RadixCache) -> None:
        self.config = config
        self.cache = cache
        self.timing = with_knobs(PROFILES[config.timing], {k: getattr(config, k) for k in KNOBS})
        self.waiting: deque[Job] = deque()
        self.prefilling: list[Job] = []
        self.decoding: list[Job] = []
        self.inflight: set[Job] = set()  # prefill mode: prefilled, KV being sent
        self._loop: asyncio.AbstractEventLoop | None = None
        self._busy = False  # a turn is scheduled or a step is running
        self._handle: asyncio.Handle | None = None
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.cached_tokens_total = 0
        self.requests_total = 0
        # Scheduler._record_step_counters: prefill steps' busy time and the tokens they
        # extended (reported in /v1/loads as total_prefill_busy_us/_uncached_tokens)
        self.prefill_busy_us_total = 0
        self.prefill_step_tokens_total = 0
        self._step: tuple[int, float] = (0, 0.0)
        self._gpu_free_at = float("-inf")  # when the modelled GPU ends its last step
        self._hits: deque[tuple[int, int]] = deque(maxlen=_HIT_WINDOW)
        self._gen_marks: deque[tuple[float, int]] = deque()

    # ---- lifecycle -------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._busy = False
        self._kick()

    async def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._busy = True  # no more turns
        self._loop = None

    # ---- entry points used by the flows ----------------------------------
    def submit_prefill(self, job: Job) -> None:
        """Queue a job for prefill; `job.prefilled` is set (and the job woken) at its first token."""
        job.phase = "waiting"
        job.cached_tokens = self.cache.match(job.spec.input_ids)
        self.waiting.append(job)
        self._kick()

    def submit_decode(self, job: Job) -> None:
        """Continue a job whose KV and first token came from a prefill server."""
        self.requests_total += 1
        self.prompt_tokens_total += job.prompt_tokens
        self.cached_tokens_total += job.cached_tokens
        if job.done:
            return
        job.phase = "waiting"
        self.waiting.append(job)
        self._kick()

    def release(self, job: Job) -> None:
        """Prefill mode: the KV of `job` left the server; free its slot."""
        if job in self.inflight:
            self.inflight.discard(job)
            self._kick()

    def drop(self, job: Job) -> None:
        """Forget a cancelled, aborted or failed job wherever it is."""
        for queue in (self.prefilling, self.decoding):
            if job in queue:
                queue.remove(job)
        if job in self.waiting:
            self.waiting.remove(job)
        self.release(job)

    # ---- load figures ----------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.prefilling) + len(self.decoding) + len(self.inflight)

    @property
    def num_used_tokens(self) -> int:
        running = (*self.prefilling, *self.decoding, *self.inflight)
        return sum(j.context_len for j in running)

    @property
    def num_total_tokens(self) -> int:
        """Used plus queued prompt tokens (LoadSnapshot.num_total_tokens, the DP budget's load)."""
        return self.num_used_tokens + sum(j.context_len for j in self.waiting)

    @property
    def waiting_uncached_tokens(self) -> int:
        """Uncached prompt tokens not yet in a prefill batch. Mirrors SGLang's
        `LoadInquirer.get_num_waiting_uncached_tokens`: the waiting queue's uncached tokens
        plus what the chunked request has left. SGLang's PrefillAdder takes a request out of
        its waiting queue only into a batch; this engine admits to `prefilling` at once and
        cuts each batch from that list, so a job there counts with what it has left to extend
        (all of it until its first chunk runs, the rest for a chunked one)."""
        return sum(max(0, j.prompt_tokens - j.cached_tokens) for j in self.waiting) \
            + sum(j.remaining_prefill for j in self.prefilling)

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

    # ---- the scheduler ---------------------------------------------------
    def _kick(self) -> None:
        """Schedule a turn unless one is scheduled or running."""
        if not self._busy and self._loop is not None:
            self._busy = True
            self._handle = self._loop.call_soon(self._turn)

    def _turn(self) -> None:
        self._handle = None
        self._admit()
        if self.prefilling:
            self._start_prefill()
        elif self.decoding:
            self._start_decode()
        else:
            self._idle()  # until submit() or release()

    def _after(self, started: float, seconds: float, step_end: Callable[..., None],
               *args: Any) -> None:
        """End a step `seconds` after `started`; in --fast mode in the next callback.

        Never synchronously: a streaming reader woken by the previous step
        runs first and sees every token, as with a real GPU.
        """
        assert self._loop is not None
        if seconds <= 0:
            self._handle = self._loop.call_soon(step_end, *args)
        else:
            started = self._on_gpu(started, seconds)
            self._handle = self._loop.call_at(started + seconds, step_end, *args)

    def _on_gpu(self, now: float, seconds: float) -> float:
        """When a step starts on the modelled GPU: where the last one ended, if the loop
        comes back to it less than a step late and the engine did not go idle in between,
        else now.

        mirrors SGLang's overlap loops (`event_loop_overlap_disagg_decode`,
        `event_loop_overlap_disagg_prefill`, `event_loop_overlap`): the next batch is
        launched before the last one's result is processed, and the tokens reach the clients
        through the detokenizer and tokenizer-manager processes, beside the GPU. Here that
        CPU work (each woken stream writing its chunk) runs between two steps on the same
        loop; timed from the loop's return it added about 2-3 ms to every 10 ms decode step
        at 100+ streams (device goodput runs: ITL p50 12-13 ms where the H200 table gives
        10.2-10.4), and the cluster served a fifth fewer tokens than its calibration."""
        lag = now - self._gpu_free_at
        started = self._gpu_free_at if 0.0 <= lag <= seconds else now
        self._gpu_free_at = started + seconds
        return started

    def _next_turn(self) -> None:
        """Yield to the loop between turns, so new arrivals join the next batch."""
        self._handle = None
        if (self.waiting or self.prefilling or self.decoding) and self._loop is not None:
            self._handle = self._loop.call_soon(self._turn)
        else:
            self._idle()

    def _idle(self) -> None:
        """Nothing to run: the next step starts when it is launched, not where the last
        one ended (`_on_gpu`)."""
        self._busy = False
        self._gpu_free_at = float("-inf")

    def _admit(self) -> None:
        if not self.waiting:
            return
        limit = self.config.max_running_requests
        running, used = self.num_running, self.num_used_tokens  # kept up to date below
        while self.waiting and running < limit:
            job = self.waiting[0]
            need = job.context_len + max(0, job.spec.max_new_tokens - len(job.output_ids))
            if running and used + need > self.config.max_total_tokens:
                return
            self.waiting.popleft()
            if job.first is not None:  # decode mode: KV already here
                running += self._join_decode(job)
                used += job.context_len
                continue
            running += 1
            used += job.context_len
            job.cached_tokens = self.cache.match(job.spec.input_ids)
            job.remaining_prefill = job.prompt_tokens - job.cached_tokens
            job.phase = "prefill"
            self.prefilling.append(job)

    def _join_decode(self, job: Job) -> int:
        """A transferred request joins the running batch, and only now is the prefill's first
        token streamed: SGLang's decode takes it from its waiting queue into a prebuilt batch
        (`SchedulerDisaggregationDecodeMixin.get_new_prebuilt_batch`) and streams it in
        `BatchResultProcessor.process_batch_result_prebuilt`, so a request queued for room
        on the decode shows nothing until then. Returns how many joined (0: it finished with
        that token)."""
        token, logprob = job.first or (0, 0.0)
        job.first = None
        job.add_token(token, logprob)
        self._count_generated(1)
        if job.done:
            return 0
        job.phase = "decoding"
        self.decoding.append(job)
        return 1

    def _start_prefill(self) -> None:
        assert self._loop is not None
        started = self._loop.time()
        budget = self.config.chunked_prefill_size
        chunks: list[tuple[int, int]] = []  # (extended now, KV already in the pool)
        for job in self.prefilling:
            if budget <= 0:
                break
            take = min(job.remaining_prefill, budget)
            chunks.append((take, job.prompt_tokens - job.remaining_prefill))
            job.remaining_prefill -= take
            budget -= take
        tokens = sum(take for take, _ in chunks)
        # mirrors one ScheduleBatch in extend mode (ModelRunner.forward_extend): a chunk of a
        # prompt attends over its cached prefix and the chunks before it (PrefillAdder's
        # chunked requests); the H200 table's prefill rows calibrate it.
        seconds = self.timing.prefill_batch_ms(chunks) / 1e3
        self._step = (tokens, seconds)
        self._after(started, seconds, self._end_prefill)

    def _end_prefill(self) -> None:
        tokens, seconds = self._step
        self.prefill_step_tokens_total += tokens
        self.prefill_busy_us_total += int(seconds * 1e6)
        done = [j for j in self.prefilling if j.remaining_prefill <= 0]
        if done:
            self.prefilling = [j for j in self.prefilling if j.remaining_prefill > 0]
        for job in done:
            if not job.done:
                self._prefill_done(job)
        if self.decoding:
            self._start_decode()
        else:
            self._next_turn()

    def _prefill_done(self, job: Job) -> None:
        self.requests_total += 1
        self.prompt_tokens_total += job.prompt_tokens
        self.cached_tokens_total += job.cached_tokens
        self._hits.append((job.prompt_tokens, job.cached_tokens))
        self.cache.insert(job.spec.input_ids)
        if self.config.mode == "prefill":
            job.stage_first_token()
            self._count_generated(1)
            job.prefilled = True
            self.inflight.add(job)
            job.wake()
            return
        if job.spec.max_new_tokens <= 0:
            job.finish({"type": "length", "length": 0})
        else:
            job.next_token()
            self._count_generated(1)
        job.prefilled = True
        if job.done:
            self._cache_finished(job)
        else:
            job.phase = "decoding"
            self.decoding.append(job)

    def _start_decode(self) -> None:
        assert self._loop is not None
        started = self._loop.time()
        cfg = self.config
        batch = list(self.decoding)
        if cfg.token_delay is not None:
            seconds = cfg.token_delay
        else:
            # mirrors ModelRunner.forward_decode replayed from CudaGraphRunner's graph: the
            # H200 table's decode rows (batch x context) calibrate it
            seconds = self.timing.decode_ms(len(batch), sum(j.context_len for j in batch)) / 1e3
        self._after(started, seconds, self._end_decode, batch)

    def _end_decode(self, batch: list[Job]) -> None:
        produced = 0
        for job in batch:
            if job.done:
                continue
            job.next_token()
            produced += 1
        self._count_generated(produced)
        finished = [j for j in self.decoding if j.done]
        if finished:
            self.decoding = [j for j in self.decoding if not j.done]
        for job in finished:
            if job.error is None and not job.cancelled:
                self._cache_finished(job)
        self._next_turn()

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

