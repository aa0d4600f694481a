"""The PD latency model: a request's TTFT and mean ITL on a (prefill target, decode) pair.

    ttft = wait(prefill) + compute(prefill, new, cached) + transfer(pair, prompt)
           + admit(decode)
    itl  = decode_step(decode's batch + 1, its context + this prompt)

* wait: the uncached tokens queued ahead on the prefill target (the larger of its fresh
  `/v1/loads` `num_waiting_uncached_tokens` and what this gateway has in flight there, never
  the sum: ours are among the server's) over its speed;
* compute: the prompt's uncached part at the server's measured prefill speed (`/v1/loads`
  busy counters, `ServerLoad.prefill_speed`), plus attention over the cached part, scaled
  like the speed; the physics prior (gateway/slo/physics.py) until the server has prefilled;
* transfer: KV bytes per prompt token over the link, plus one setup;
* admit: one decode step while the decode has room, else the wait for running requests to
  finish: for a slot (`max_running_requests`; their learned mean duration), and for the KV
  this prompt needs beyond what its pool has free (`max_total_tokens`; the pool's learned
  turnover, token-weighted; SGLang's decode admits
  a transferred request only when its KV fits, and the first token waits for that: near
  capacity the pool, not the slots, is what requests queue for);
* decode_step: the physics prior at the decode's running batch and context tokens.

Learned online (`observe`): the gateway compares what it predicted with what it saw (TTFT
from the pick, mean ITL of the stream) and keeps, per prefill target, per (prefill, decode)
pair and per decode, a factor: an exponentially weighted mean of log(observed / predicted),
clamped to [1/8, 8]. TTFT factors are layered: the fleet's (what every pair shows), what a
prefill target adds to it, what a pair adds to that (its transfer path, its decode's
admission); a target not yet observed has the fleet's. They start at 1 (the physics, and
the server's own speed). A forecast made before its prefill reported a speed (the prior's)
has a factor of its own, learned only from such forecasts (`measured`).

What sets one server or pair apart (the target's, the pair's and the decode's ITL factors,
not the fleet's or the prior's) fades towards the fleet's unless observations confirm it
(by 1/e per `FADE` seconds): a pair that looked slow during a passing fault is no longer
picked, so nothing it does corrects it, and without the fade the objective traffic stayed
on the other decode for good (docs/SCHEDULING.md). Faded, it comes back within the tie
band, is picked again, and relearned.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from gateway.servers.pool import Server
from gateway.slo.physics import H200_LLAMA3_8B, Physics

LOAD_MAX_AGE = 6.0  # seconds a /v1/loads snapshot counts as fresh (three polls at 2 s)
ALPHA = 0.2  # weight of a new observation in a learned factor
CLAMP = math.log(8.0)  # a factor stays within [1/8, 8]
DECODE_DURATION = 10.0  # seconds a request holds a decode slot, until learned
FADE = 60.0  # seconds in which an unconfirmed server or pair factor fades by 1/e
FADE_EVERY = 1.0  # seconds between fades (done as requests are observed: no timer)


@dataclass(frozen=True, slots=True)
class Prediction:
    """One pair's forecast for one request, in seconds; `raw_*` before the learned factors
    (what `observe` compares with)."""

    ttft: float
    itl: float
    wait: float
    compute: float
    transfer: float
    admit: float
    raw_ttft: float
    raw_itl: float
    measured: bool = True  # the prefill's speed was its own, not the prior (`combine`)


def fresh(server, now: float | None = None, max_age: float = LOAD_MAX_AGE) -> bool:
    """Whether the server's `/v1/loads` snapshot is recent enough to trust."""
    updated = server.load.updated_at
    return updated > 0.0 and (now if now is not None else time.monotonic()) - updated <= max_age


def prefill_speed(server, physics: Physics = H200_LLAMA3_8B) -> float:
    """Tokens/s the server prefills at: measured from its reports, else the prior."""
    return server.load.prefill_speed or physics.prefill_tokens_per_second


def queued_tokens(server, now: float | None = None) -> float:
    """Uncached prompt tokens waiting ahead of a new request on a prefill server or rank:
    the larger of what this gateway has in flight there and what the server last reported
    less what it has prefilled since (its speed times the report's age; a snapshot is up to
    a poll interval old, and a queue of seconds drains by then)."""
    ours = float(server.totals()[1])
    now = time.monotonic() if now is None else now
    if fresh(server, now):
        load = server.load
        drained = load.prefill_speed * max(0.0, now - load.updated_at)
        return max(ours, float(load.waiting_uncached_tokens) - drained)
    return ours


def predicted_wait(server: Server, now: float | None = None,
                   physics: Physics = H200_LLAMA3_8B) -> float:
    """Seconds a request arriving now waits in `server`'s prefill queue before its own
    compute starts: the work ahead of it over the server's speed. Pure (no learned state),
    so any part of the gateway may ask (the hang deadlines: a queued request is not a hung
    one)."""
    return queued_tokens(server, now) / prefill_speed(server, physics)


def _log_ratio(observed: float, predicted: float) -> float:
    ratio = math.log(max(observed, 1e-4) / max(predicted, 1e-4))
    return max(-CLAMP, min(CLAMP, ratio))


class LatencyModel:
    """Forecasts per pair, with factors learned per server and per pair."""

    def __init__(self, physics: Physics = H200_LLAMA3_8B) -> None:
        self.physics = physics
        # log factors: the fleet's (what every pair shows: the gateway's own path, a
        # slower device than the prior's), then what a target and a pair add to it; a
        # target nobody has observed yet starts at the fleet's, not at the prior, so the
        # ones observed do not look slower than the unknown ones for being known
        self._fleet = 0.0
        # the log factor of forecasts made with the physics prior's speed, before a prefill
        # has reported its own: kept apart, or the prior's error (6x on a 32B model) would
        # stay in the fleet's factor and multiply the forecasts made with the measured speed
        self._prior = 0.0
        self._ttft: dict[str, float] = {}  # prefill target url -> log factor
        self._pair: dict[tuple[str, str], float] = {}  # (prefill, decode) -> log factor
        self._itl: dict[str, float] = {}  # decode url -> log factor
        self._duration: dict[str, float] = {}  # decode url -> mean seconds a request holds it
        # decode url -> (EWMA of tokens x seconds, EWMA of tokens): the seconds a token of
        # its KV pool is held, weighted by the tokens (the pool's turnover time)
        self._held: dict[str, tuple[float, float]] = {}
        self.observed = 0
        self._faded = time.monotonic()  # when the server and pair factors last faded
        # decode url -> the ITL objectives (seconds) of requests running there: decode
        # protection keeps new requests off a decode whose step would break the tightest
        self._bounds: dict[str, list[float]] = {}

    # -- the parts -----------------------------------------------------------------------------

    def prefill_part(self, target, new: float, cached: float, now: float) -> tuple[float, float]:
        """(wait, compute) seconds on a prefill target for `new` uncached tokens after
        `cached` cached ones."""
        physics = self.physics
        speed = prefill_speed(target, physics)
        scale = physics.prefill_tokens_per_second / speed  # the server's pace against the prior
        wait = queued_tokens(target, now) / speed
        compute = 0.0
        if new > 0:
            compute = physics.prefill_fixed + new / speed \
                + physics.attention(new, cached) * scale
        return wait, compute

    def decode_part(self, decode, prompt: float, now: float) -> tuple[float, float]:
        """(admit, step) seconds on a decode: the wait for a slot, and its step time once
        this request runs there."""
        requests, tokens = decode.totals()
        load = decode.load
        batch, context = float(requests), float(tokens)
        if fresh(decode, now):
            batch = max(batch, float(load.running + load.waiting - load.settled))
            context = max(context, float(load.used_tokens))
        step = self.physics.decode_step(batch + 1, context + prompt)
        admit = step
        duration = self._duration.get(decode.url, DECODE_DURATION)
        limit = load.max_running_requests
        if limit and batch >= limit:  # full: a slot frees as a running request finishes
            admit += (batch - limit + 1) / limit * duration
        pool = load.max_total_tokens
        if pool and context + prompt > pool:  # its KV waits for that much of the pool to free,
            admit += (context + prompt - pool) / pool * self.turnover(decode.url)
        return admit, step

    def turnover(self, decode_url: str) -> float:
        """Seconds the decode's KV pool takes to turn over: the token-weighted mean time its
        requests hold it (Little's law: tokens free at pool / that time). Weighted by
        requests it read 2.5x short under a sudden overload: the short answers end first
        and hold little of the pool, the long prompts hold most of it."""
        held = self._held.get(decode_url)
        if held is None or held[1] <= 0:
            return self._duration.get(decode_url, DECODE_DURATION)
        return held[0] / held[1]

    def transfer(self, prompt: float) -> float:
        """Seconds to move the prompt's KV to the decode (the prior; pairs learn theirs)."""
        return self.physics.transfer(prompt)

    @staticmethod
    def measured(target) -> bool:
        """Whether the target's prefill speed is its own (`/v1/loads`), not the prior."""
        return target.load.prefill_speed > 0

    def combine(self, target_url: str, decode_url: str, wait: float, compute: float,
                transfer: float, admit: float, step: float, measured: bool = True) -> Prediction:
        """The pair's forecast from its parts, with what was learned of its servers; on the
        prior's speed (`measured` false) with the prior's own factor only."""
        raw = wait + compute + transfer + admit
        if measured:
            log = self._fleet + self._ttft.get(target_url, 0.0) \
                + self._pair.get((target_url, decode_url), 0.0)
        else:
            log = self._prior
        return Prediction(raw * math.exp(log), self.itl(decode_url, step), wait, compute,
                          transfer, admit, raw, step, measured)

    def itl(self, decode_url: str, step: float) -> float:
        """The decode's predicted ITL for a step the prior prices at `step` seconds."""
        return step * math.exp(self._itl.get(decode_url, 0.0))

    def predict(self, target, decode, prompt: float, cached: float,
                now: float | None = None) -> Prediction:
        """The forecast for a request of `prompt` tokens, `cached` of them held by the
        target, on the pair (target, decode)."""
        now = time.monotonic() if now is None else now
        cached = min(cached, prompt)
        wait, compute = self.prefill_part(target, prompt - cached, cached, now)
        admit, step = self.decode_part(decode, prompt, now)
        return self.combine(target.url, decode.url, wait, compute, self.transfer(prompt),
                            admit, step, self.measured(target))

    # -- decode protection -----------------------------------------------------------------

    def hold(self, decode_url: str, itl: float) -> None:
        """A request with ITL objective `itl` now runs on the decode."""
        self._bounds.setdefault(decode_url, []).append(itl)

    def release(self, decode_url: str, itl: float) -> None:
        bounds = self._bounds.get(decode_url)
        if bounds and itl in bounds:
            bounds.remove(itl)
            if not bounds:
                del self._bounds[decode_url]

    def tightest(self, decode_url: str) -> float | None:
        """The smallest ITL objective among the decode's running requests (None: none)."""
        bounds = self._bounds.get(decode_url)
        return min(bounds) if bounds else None

    # -- learning ------------------------------------------------------------------------------

    def observe(self, target_url: str, decode_url: str, predicted: Prediction,
                ttft: float | None, itl: float | None, duration: float | None = None,
                tokens: float = 0.0, now: float | None = None) -> None:
        """What one request saw on the pair it was sent to (seconds; None: not seen);
        `tokens`: the KV it held on the decode (prompt and completion)."""
        self.observed += 1
        self._fade(time.monotonic() if now is None else now)
        if ttft is not None:
            self.learn_ttft(target_url, decode_url, predicted, ttft)
        if itl is not None and itl > 0:
            own = self._itl.get(decode_url, 0.0)
            self._itl[decode_url] = own + ALPHA * (_log_ratio(itl, predicted.raw_itl) - own)
        if duration is not None and duration > 0:
            mean = self._duration.get(decode_url, duration)
            self._duration[decode_url] = mean + ALPHA * (duration - mean)
            if tokens > 0:
                held = self._held.get(decode_url)
                if held is None:
                    self._held[decode_url] = (tokens * duration, tokens)
                else:
                    self._held[decode_url] = (held[0] + ALPHA * (tokens * duration - held[0]),
                                              held[1] + ALPHA * (tokens - held[1]))

    def learn_ttft(self, target_url: str, decode_url: str, predicted: Prediction,
                   ttft: float) -> None:
        """One request's first token came `ttft` seconds after its pick (the layered TTFT
        factors: the fleet's, its target's, its pair's)."""
        if ttft <= 0:
            return
        error = _log_ratio(ttft, predicted.raw_ttft)
        if not predicted.measured:  # the prior's error, not the fleet's (`_prior`)
            self._prior += ALPHA * (error - self._prior)
            return
        self._fleet += ALPHA * (error - self._fleet)
        error -= self._fleet  # what this target adds to what every target shows
        own = self._ttft.get(target_url, 0.0)
        own += ALPHA * (error - own)
        self._ttft[target_url] = own
        key = (target_url, decode_url)
        pair = self._pair.get(key, 0.0)
        self._pair[key] = pair + ALPHA * ((error - own) - pair)

    def _fade(self, now: float) -> None:
        """Every server and pair factor towards the fleet's, by the time since the last fade."""
        elapsed = now - self._faded
        if elapsed < FADE_EVERY:
            return
        self._faded = now
        keep = math.exp(-elapsed / FADE)
        for table in (self._ttft, self._pair, self._itl):
            for key in table:
                table[key] *= keep

    def forget_targets(self, present: set[str]) -> None:
        """Drop what was learned of prefill targets that left (and of their pairs)."""
        for url in [u for u in self._ttft if u not in present]:
            del self._ttft[url]
        for key in [k for k in self._pair if k[0] not in present]:
            del self._pair[key]

    def factors(self) -> dict:
        """The learned factors (the admin API's policy figures)."""
        return {
            "fleet": round(math.exp(self._fleet), 3),
            "prior": round(math.exp(self._prior), 3),
            "ttft": {url: round(math.exp(v), 3) for url, v in self._ttft.items()},
            "pair": {f"{p} -> {d}": round(math.exp(v), 3) for (p, d), v in self._pair.items()},
            "itl": {url: round(math.exp(v), 3) for url, v in self._itl.items()},
            "observed": self.observed,
        }
