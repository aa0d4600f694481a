"""Per-API-key limits: requests per second and prompt tokens per minute, as token buckets.

Two buckets per inference key, refilled continuously:
* requests: `--rate-limit` per second, up to `--rate-burst` at once (taken when the key is
  checked, before the body is read);
* prompt tokens: `--rate-limit-tokens` per minute, up to one minute's worth at once (taken
  once the prompt is counted: exactly with the served model's tokenizer or for token-id
  prompts, else the characters/4 estimate). A request larger than a whole minute's worth
  could never pass: it is refused with 429 at once rather than queued forever. A request of
  `n` samples is charged its prompt n times (each sample is a request to the servers).
  The charge is taken before the request waits for a slot, so a key over its limit never
  queues, and queued requests see each other's charges; a request refused or gone before a
  server was asked (context, SLO, queue full, deadline, shed, client left) gets it back
  (`give_back`, once: docs/TENANCY.md). Completion tokens are not charged: they are bounded
  per request by its own max_tokens, and known only at the end.

With `--workers N` the buckets live in the shared block (gateway/processes/shared_state.py), so the
limits hold for the gateway as a whole; `take` below is the one refill-and-take rule both
places use.
"""

from __future__ import annotations

import math
import time

from gateway.errors import TooManyRequests

REQUESTS, TOKENS = 0, 1  # the two buckets of a key


def take(tokens: float, last: float, now: float, rate: float, burst: float,
         cost: float) -> tuple[float, float, float]:
    """(tokens left, refill time, seconds to wait: 0.0 if `cost` was taken).

    A bucket never used (`last` 0) starts full. A negative `cost` gives tokens back, never
    past `burst` (a refund cannot mint more than a full bucket)."""
    tokens = burst if last == 0.0 else min(burst, tokens + (now - last) * rate)
    if tokens < cost:
        return tokens, now, (cost - tokens) / rate
    return min(burst, tokens - cost), now, 0.0


class KeyRateLimited(TooManyRequests):
    """A key's own request bucket is empty. Raised while the key is being checked, before
    the request knows its tenant: `key_index` lets the refusal count under the key's tenant
    (access log, /admin/usage, tenant metrics), not `anonymous`."""

    def __init__(self, message: str, key_index: int, retry_after: float) -> None:
        super().__init__(message, headers={"retry-after": str(max(1, math.ceil(retry_after)))})
        self.key_index = key_index


class KeyLimits:
    def __init__(self, keys: int, rate: float = 0.0, burst: int = 1,
                 tokens_per_minute: float = 0.0, metrics=None, shared=None,
                 clock=time.monotonic) -> None:
        self.rate = rate
        self.burst = float(max(burst, 1))
        self.tokens_per_minute = tokens_per_minute
        self._metrics = metrics
        self._shared = shared  # SharedState with --workers
        self._clock = clock
        self._local = [[[0.0, 0.0], [0.0, 0.0]] for _ in range(keys)]

    def take_request(self, key: int) -> None:
        """One request of inference key number `key`, or 429 with Retry-After."""
        if self.rate > 0:
            self._take(key, REQUESTS, self.rate, self.burst, 1.0,
                       f"rate limit of {self.rate:g} requests/s for this API key exceeded")

    def take_tokens(self, key: int | None, count: int, samples: int = 1) -> int:
        """`count` prompt tokens x `samples` of key number `key` (None: no key, no limit),
        or 429. Returns what was charged (0: nothing), for `give_back`."""
        if self.tokens_per_minute <= 0 or key is None:
            return 0
        tpm = self.tokens_per_minute
        cost = count * samples
        if cost > tpm:
            self._refused()
            times = f" x {samples} samples" if samples > 1 else ""
            raise TooManyRequests(
                f"the prompt's {count} tokens{times} exceed this API key's limit of {tpm:g} "
                "prompt tokens per minute; send a shorter prompt")
        self._take(key, TOKENS, tpm / 60.0, tpm, float(cost),
                   f"limit of {tpm:g} prompt tokens per minute for this API key exceeded")
        return cost

    def give_back(self, key: int | None, charged: int) -> None:
        """Return `charged` (take_tokens' answer) to key `key`'s token bucket: the request
        was refused before any server was asked, so it sent no prompt tokens. The caller
        calls it at most once per charge."""
        if not charged or key is None:
            return
        tpm = self.tokens_per_minute
        now = self._clock()
        if self._shared is not None:
            self._shared.take_from_bucket(key, TOKENS, tpm / 60.0, tpm, -float(charged), now)
        else:
            bucket = self._local[key][TOKENS]
            bucket[0], bucket[1], _ = take(bucket[0], bucket[1], now, tpm / 60.0, tpm,
                                           -float(charged))

    def _take(self, key: int, kind: int, rate: float, burst: float, cost: float,
              message: str) -> None:
        now = self._clock()
        if self._shared is not None:
            wait = self._shared.take_from_bucket(key, kind, rate, burst, cost, now)
        else:
            bucket = self._local[key][kind]
            bucket[0], bucket[1], wait = take(bucket[0], bucket[1], now, rate, burst, cost)
        if wait:
            self._refused()
            raise KeyRateLimited(message, key, wait)

    def _refused(self) -> None:
        if self._metrics is not None:
            self._metrics.rejections.labels("rate_limit").inc()
