"""Parallel sampling (n > 1) as n single-sample PD requests, merged into one SGLang answer.

SGLang cannot serve n > 1 in PD mode: `GenerateReqInput._normalize_bootstrap_params` repeats
the room list n times and `TokenizerManager._handle_batch_request` sends a warm-up prefill and
then all n samples with prompt i's room, so one room serves n + 1 requests, which the PD
handshake cannot pair (the request hangs on 0.5.23). The gateway therefore sends n requests with
n = 1, each with its own rooms, and merges their answers into exactly what one server returns
for n > 1 (docs/FIDELITY.md):

* order: prompt-major, item i * n + j is sample j of prompt i (`_handle_batch_request`);
  native lists and streamed `index`, OpenAI `choices[].index` follow it;
* usage: prompt (and cached) tokens once per prompt, from sample 0; completion tokens summed
  (`UsageProcessor.calculate_response_usage`);
* placement: like SGLang's warm-up, sample 0 goes first; when its prefill has finished, the
  other samples follow on the same prefill server (and DP rank), where the prompt is now
  cached. Each sample picks its decode server with the decode policy, so samples spread over
  decode servers as independent requests would.

Failures: each sample retries on another pair (before anything streamed), avoiding the
servers any sample was failed by (`proxy.Shared`); a sample that still fails fails the whole
request and stops the others. A stream starts at the first sample's first chunk, as one
server's n > 1 stream does (its first token is not held back for the slowest sample's, which
follows sample 0's prefill); a failure before that is a clean error answer; later, an error
event and one `[DONE]` end the merged stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator

import orjson

from gateway.dispatch.pd import Answer
from gateway.dispatch.proxy import Shared
from gateway.errors import GatewayError, UpstreamError
from gateway.request import CHAT, COMPLETIONS, GENERATE, RequestView
from gateway.sse import DONE, NOT_JSON, EventSplitter, frame, parsed

log = logging.getLogger("gateway.dispatch.parallel_samples")
IDENTITY = ("id", "created", "model")  # an OpenAI chunk's fields naming its stream
QUEUE_DEPTH = 8  # chunks a sample may be ahead of the client (backpressure beyond that)


def single_sample(view: RequestView) -> RequestView:
    """The view of one sample: the same request with n = 1 and no client rid (SGLang gives
    every sample its own rid; the client's rid stays the handle for /abort_request)."""
    body = dict(view.body)
    body.pop("rid", None)
    if view.endpoint == GENERATE:
        params = body.get("sampling_params")
        if isinstance(params, list):
            body["sampling_params"] = [{**p, "n": 1} for p in params]
        else:
            body["sampling_params"] = {**(params or {}), "n": 1}
    else:
        body["n"] = 1
    return dataclasses.replace(view, body=body, n=1, rids=None)


class Samples:
    def __init__(self, proxy) -> None:
        self.proxy = proxy

    async def handle(self, view: RequestView, tracked) -> Answer:
        sample = single_sample(view)
        n = view.n
        placement = Placement()
        tasks = [asyncio.get_running_loop().create_task(
            self.proxy.handle(sample, tracked, placement=placement))]
        try:
            await placement.wait_first(tasks[0])
            tasks += [asyncio.get_running_loop().create_task(
                self.proxy.handle(sample, tracked, placement=placement)) for _ in range(n - 1)]
            if view.stream:
                first = await _first_answer(tasks)
            else:
                answers = await _all_or_nothing(tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await _close_all(tasks)
            raise
        if not view.stream:
            merged = merge_bodies(view, sample_bodies(view, answers))
            return Answer(answers[0].status, answers[0].content_type, orjson.dumps(merged))
        stream = MergedStream(view, tasks, tracked)
        return Answer(200, first.content_type, stream=stream.events(), close=stream.close)


FOLLOW_WAIT = 0.5  # seconds the other samples wait for sample 0's prefill to answer


class Placement:
    """Where sample 0's prompt got cached, so the other samples can follow it there."""

    def __init__(self) -> None:
        self.shared = Shared()  # what every sample's attempts learned (proxy.Shared)
        self.prefill_done: asyncio.Future = asyncio.get_running_loop().create_future()
        self._claimed = False
        self._first: tuple | None = None  # sample 0's (prefill server, DP rank) as picked

    def started(self, attempt) -> None:
        """Called for every attempt of every sample; the very first one reports its prefill."""
        if not self._claimed:
            self._claimed = True
            attempt.prefill_future = self.prefill_done
            self._first = (attempt.prefill, attempt.prefill_rank)

    @property
    def prefer(self):
        """(prefill server, DP rank) that cached the prompt, or None (not yet, or it failed)."""
        done = self.prefill_done
        return done.result() if done.done() and not done.cancelled() else None

    async def wait_first(self, first: asyncio.Task) -> None:
        """Until sample 0's first prefill has finished (or sample 0 itself ended), at most
        FOLLOW_WAIT: a prefill's HTTP answer may come long after it computed (after the
        decode's, on the CPU rig), and the samples then ran one after the other. Past the
        bound the others follow sample 0 to the prefill and rank it was sent to."""
        await asyncio.wait([first, self.prefill_done], timeout=FOLLOW_WAIT,
                           return_when=asyncio.FIRST_COMPLETED)
        if not self.prefill_done.done() and not first.done() and self._first is not None:
            self.prefill_done.set_result(self._first)
        if not self.prefill_done.done():
            self.prefill_done.cancel()


async def _all_or_nothing(tasks: list[asyncio.Task]) -> list[Answer]:
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    for task in done:
        if task.exception() is not None:
            raise task.exception()
    return [task.result() for task in tasks]


async def _first_answer(tasks: list[asyncio.Task]) -> Answer:
    """The first sample's answer (a stream: it has its first chunk); a sample that failed
    by then fails the request, while nothing was sent."""
    done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task in done:
        if task.exception() is not None:
            raise task.exception()
    return next(iter(done)).result()


async def _close_all(tasks: list[asyncio.Task]) -> None:
    for task in tasks:
        with contextlib.suppress(BaseException):
            answer = await task
            if answer.close is not None:
                await answer.close()


# -- merging whole answers --------------------------------------------------------------------

def sample_bodies(view: RequestView, answers: list[Answer]) -> list:
    """Each sample's answer parsed; one that is not the JSON its endpoint answers (a body cut
    off by a failing decode) is the server's failure, a 502, not the gateway's own 500."""
    bodies = []
    for j, answer in enumerate(answers):
        try:
            body = orjson.loads(answer.body)
        except orjson.JSONDecodeError:
            body = None
        if not isinstance(body, dict) and not (view.endpoint == GENERATE
                                               and isinstance(body, list)):
            raise UpstreamError(f"sample {j} of {view.n}: the decode server's answer "
                                f"({len(answer.body)} bytes) is not a complete JSON "
                                "answer", leg="decode", server_url="", retryable=False,
                                reason="malformed")
        bodies.append(body)
    return bodies


def merge_bodies(view: RequestView, bodies: list) -> object:
    n = view.n
    if view.endpoint == GENERATE:
        per_sample = [b if isinstance(b, list) else [b] for b in bodies]
        prompts = len(per_sample[0])
        return [per_sample[j][i] for i in range(prompts) for j in range(n)]
    merged = dict(bodies[0])
    choices = []
    for j, body in enumerate(bodies):
        for choice in body.get("choices") or []:
            choices.append({**choice, "index": choice.get("index", 0) * n + j})
    merged["choices"] = sorted(choices, key=lambda c: c["index"])
    usage = merge_usage([b.get("usage") for b in bodies])
    if usage is not None:
        merged["usage"] = usage
    return merged


def merge_usage(usages: list) -> dict | None:
    """Prompt (and cached) tokens once, from sample 0; completion tokens summed."""
    if not usages or not isinstance(usages[0], dict):
        return None
    merged = dict(usages[0])
    completion = sum(int((u or {}).get("completion_tokens") or 0) for u in usages)
    merged["completion_tokens"] = completion
    merged["total_tokens"] = int(merged.get("prompt_tokens") or 0) + completion
    reasoning = sum(int((u or {}).get("reasoning_tokens") or 0) for u in usages)
    if reasoning:
        merged["reasoning_tokens"] = reasoning
    return merged


# -- merging streams ----------------------------------------------------------------------------

def error_event(obj: dict) -> dict:
    """A sample's error event as the gateway writes errors (it re-frames the event anyway):
    `param` present and `code` a string, where SGLang writes the HTTP status as a number."""
    error = obj.get("error")
    if isinstance(error, dict):
        error.setdefault("param", None)
        if isinstance(error.get("code"), int):
            error["code"] = str(error["code"])
    return obj


class MergedStream:
    """The n sample streams interleaved as their chunks arrive, re-indexed, one [DONE].

    One pump task per sample waits for that sample's answer and reads its relay (the relay's
    deadlines belong to the task that reads it) into a small queue; the client's sender
    drains the queue, so a slow client holds the pumps back and their send deadline applies.
    A sample that fails before its first chunk, once the stream runs, is an error event,
    and the request's failure (`tracked.failure`: it counts with the error's status)."""

    def __init__(self, view: RequestView, samples: list[asyncio.Task], tracked=None) -> None:
        self.view = view
        self.tracked = tracked
        self.samples = samples  # each sample's `proxy.handle`: its answer, or its failure
        self.queue: asyncio.Queue = asyncio.Queue(QUEUE_DEPTH)
        self.pumps: list[asyncio.Task] = []
        self.usages: dict[int, dict] = {}
        self._splitters: dict[int, EventSplitter] = {}
        self._ident: tuple | None = None  # (id, created, model) of the first chunk sent

    async def events(self) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        self.pumps = [loop.create_task(self._pump(j, task))
                      for j, task in enumerate(self.samples)]
        running = len(self.pumps)
        while running:
            j, data = await self.queue.get()
            if data is None:
                running -= 1
                continue
            out, failed = self._rewrite(j, data)
            if out:
                yield out
            if failed:
                yield DONE
                return
        if self.usages:
            yield frame(self._usage_chunk())
        yield DONE

    async def _pump(self, j: int, sample: asyncio.Task) -> None:
        """Sample `j`'s chunks into the queue, then its end (None). Cancelled (by `close`),
        it stops at once: nobody reads the queue then, and a put into a full one (a client
        that stopped reading) would wait for good, and `close` with it."""
        try:
            answer = await sample
            async for chunk in answer.stream:
                await self.queue.put((j, chunk))
        except Exception as exc:  # noqa: BLE001 - its retries spent, or its relay broke
            if not isinstance(exc, GatewayError):
                log.exception("sample %d of a merged stream failed", j)
                exc = GatewayError("internal gateway error; see the gateway log")
            if self.tracked is not None:
                self.tracked.failure = exc
            await self.queue.put((j, frame(exc.body())))
        await self.queue.put((j, None))

    def _rewrite(self, j: int, data: bytes) -> tuple[bytes, bool]:
        """Re-index the complete events of one sample's chunk; (bytes, an error was seen)."""
        splitter = self._splitters.setdefault(j, EventSplitter())
        out = []
        failed = False
        for event, payload, obj in parsed(splitter, data):
            if payload is None or payload == b"[DONE]":
                continue
            if obj is NOT_JSON:
                out.append(event + b"\n\n")
                continue
            if not isinstance(obj, dict):
                continue
            if "error" in obj:
                failed = True
                out.append(frame(error_event(obj)))
                break
            if self._is_usage_chunk(obj):
                self.usages[j] = obj
                continue
            out.append(frame(self._reindex(j, obj)))
        return b"".join(out), failed

    def _is_usage_chunk(self, obj: dict) -> bool:
        return self.view.endpoint in (CHAT, COMPLETIONS) and obj.get("usage") is not None \
            and not obj.get("choices")

    def _reindex(self, j: int, obj: dict) -> dict:
        n = self.view.n
        if self.view.endpoint == GENERATE:
            obj["index"] = int(obj.get("index") or 0) * n + j
        else:
            for choice in obj.get("choices") or []:
                choice["index"] = int(choice.get("index") or 0) * n + j
            self._one_stream(obj)
        return obj

    def _one_stream(self, obj: dict) -> dict:
        """One stream, one identity: every OpenAI chunk carries the `id`, `created` and
        `model` of the first chunk sent (each sample's server named its own)."""
        if self._ident is None:
            self._ident = tuple(obj.get(key) for key in IDENTITY)
        for key, value in zip(IDENTITY, self._ident, strict=True):
            if key in obj or value is not None:
                obj[key] = value
        return obj

    def _usage_chunk(self) -> dict:
        first = self.usages.get(0) or next(iter(self.usages.values()))
        usages = [self.usages.get(j, {}).get("usage") for j in range(len(self.samples))]
        return self._one_stream({**first, "usage": merge_usage(usages) or first.get("usage")})

    async def close(self) -> None:
        """Every pump stopped, every sample still without an answer cancelled, every
        answer's legs closed."""
        for task in (*self.pumps, *self.samples):
            task.cancel()
        await asyncio.gather(*self.pumps, return_exceptions=True)
        await _close_all(self.samples)
