"""Who is calling, and may they: the one place where API keys are checked.

Roles (docs/SECURITY.md):

* `PUBLIC`: probes and scrapers (`/health`, `/readiness`, `/metrics`, the cached
  `/health_generate`): never a key.
* `INFERENCE`: generation, models, tokenizer, `/server_info`, aborting one's own requests.
  Open when no inference key is configured; otherwise an inference key.
* `ADMIN`: changing the server set, draining, flushing caches, aborting anyone's request,
  the status data. Needs an admin key; an inference key never grants it, and an admin key
  grants nothing else (least privilege: an operator's credential is not a client's). Without
  any admin key configured, the admin API answers loopback clients only (the operator on the
  host), so a gateway listening on 0.0.0.0 without keys cannot be reconfigured from the
  network.

Keys are compared in constant time against every configured key (no early exit), presented as
`Authorization: Bearer <key>` or `x-api-key: <key>`. Inference keys may carry a rate limit
(token bucket per key; buckets exist only for configured keys, so their number is bounded).
"""

from __future__ import annotations

import enum
import hmac
import ipaddress
import time
from dataclasses import dataclass

from gateway.errors import Forbidden, TooManyRequests, Unauthorized


class Role(enum.Enum):
    PUBLIC = "public"
    INFERENCE = "inference"
    ADMIN = "admin"


_PUBLIC = frozenset({Role.PUBLIC})
_PUBLIC_INFERENCE = frozenset({Role.PUBLIC, Role.INFERENCE})


@dataclass(frozen=True, slots=True)
class Caller:
    """The authenticated caller of one request."""

    roles: frozenset[Role]  # what its credentials grant (PUBLIC always)
    key_id: str | None  # "inference:3" / "admin:0"; None without a key
    loopback: bool

    @property
    def owner(self) -> str:
        """Who owns the requests this caller makes (for abort): its key, else anyone."""
        return self.key_id or "anonymous"

    @property
    def is_admin(self) -> bool:
        return Role.ADMIN in self.roles


def is_loopback(client: tuple | None) -> bool:
    if not client:
        return False
    try:
        return ipaddress.ip_address(str(client[0]).split("%")[0]).is_loopback
    except ValueError:
        return False


def presented_key(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The key a request carries: `Authorization: Bearer` first, then `x-api-key`."""
    api_key = None
    for name, value in headers:
        if name == b"authorization" and value[:7].lower() == b"bearer ":
            return value[7:].strip().decode("latin-1")
        if name == b"x-api-key":
            api_key = value.strip().decode("latin-1")
    return api_key


class _KeySet:
    """Constant-time membership over a fixed list of keys."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        self.keys = [k.encode() for k in keys]

    def index(self, candidate: bytes) -> int:
        found = -1
        for index, key in enumerate(self.keys):  # no early exit: constant time over keys
            if hmac.compare_digest(candidate, key):
                found = index
        return found


class Auth:
    """Identifies callers and enforces the role a route needs."""

    def __init__(self, inference_keys: tuple[str, ...], admin_keys: tuple[str, ...],
                 rate: float = 0.0, burst: int = 1, metrics=None, clock=time.monotonic) -> None:
        self.inference = _KeySet(inference_keys)
        self.admin = _KeySet(admin_keys)
        self.rate = rate
        self.burst = max(burst, 1)
        self._metrics = metrics
        self._clock = clock
        self._buckets = [[float(self.burst), clock()] for _ in inference_keys]

    @property
    def inference_open(self) -> bool:
        return not self.inference.keys

    @property
    def admin_keys_set(self) -> bool:
        return bool(self.admin.keys)

    def caller(self, scope: dict, needed: Role) -> Caller:
        """The caller of `scope`, or an error if it lacks role `needed`."""
        loopback = is_loopback(scope.get("client"))
        key = presented_key(scope["headers"])
        if key is not None and (self.inference.keys or self.admin.keys):
            caller = self._by_key(key, loopback, needed)
        else:
            caller = Caller(self._open, None, loopback)
        if needed in caller.roles:
            return caller
        if needed is Role.ADMIN:
            if not self.admin_keys_set and loopback:
                return Caller(caller.roles | {Role.ADMIN}, caller.key_id, loopback)  # operator
            if caller.key_id is not None:
                raise Forbidden("this API key has no admin rights")
            if not self.admin_keys_set:
                raise Forbidden("the admin API answers only loopback clients until admin keys "
                                "are configured (--admin-api-key-file or GATEWAY_ADMIN_API_KEYS)")
        if caller.key_id is not None:
            raise Unauthorized("this API key is not an inference key")
        raise Unauthorized("missing API key (Authorization: Bearer <key>)")

    @property
    def _open(self) -> frozenset[Role]:
        """What a caller without a key may do."""
        return _PUBLIC_INFERENCE if self.inference_open else _PUBLIC

    def _by_key(self, key: str, loopback: bool, needed: Role) -> Caller:
        candidate = key.encode("latin-1")
        admin = self.admin.index(candidate)
        inference = self.inference.index(candidate)
        if admin >= 0:
            return Caller(self._open | {Role.ADMIN}, f"admin:{admin}", loopback)
        if inference >= 0:
            if self.rate > 0 and needed is Role.INFERENCE:
                self._take(inference)
            return Caller(_PUBLIC_INFERENCE, f"inference:{inference}", loopback)
        if needed is Role.PUBLIC:
            return Caller(_PUBLIC, None, loopback)
        raise Unauthorized("invalid API key")

    def _take(self, index: int) -> None:
        bucket = self._buckets[index]
        now = self._clock()
        bucket[0] = min(self.burst, bucket[0] + (now - bucket[1]) * self.rate)
        bucket[1] = now
        if bucket[0] < 1.0:
            wait = (1.0 - bucket[0]) / self.rate
            if self._metrics is not None:
                self._metrics.rejections.labels("rate_limit").inc()
            raise TooManyRequests(
                f"rate limit of {self.rate:g} requests/s for this API key exceeded",
                headers={"retry-after": str(max(1, round(wait + 0.5)))})
        bucket[0] -= 1.0

    def describe(self) -> str:
        """One line for the startup log."""
        inference = "open (no keys)" if self.inference_open else f"{len(self.inference.keys)} keys"
        admin = (f"{len(self.admin.keys)} keys" if self.admin_keys_set
                 else "loopback clients only (no admin keys)")
        return f"inference: {inference}; admin: {admin}"
