"""Who is calling, and may they: the one place where API keys are checked.

Roles (docs/SECURITY.md):

* `PUBLIC`: probes and scrapers (`/health`, `/readiness`, `/metrics`, the cached
  `/health_generate`): never a key.
* `INFERENCE`: generation, models, tokenizer, `/server_info` (without the servers'
  addresses), aborting one's own requests. Open when no inference key is configured;
  otherwise an inference key.
* `ADMIN`: changing the server set, draining, flushing caches, aborting anyone's request,
  `/server_info` with the addresses (those two take either role: `app.EITHER`), the status
  data.
  Needs an admin key; an inference key never grants it, and an admin key grants nothing
  else (least privilege: an operator's credential is not a client's). Without
  any admin key configured, the admin API answers loopback clients only (the operator on the
  host), so a gateway listening on 0.0.0.0 without keys cannot be reconfigured from the
  network.

Keys are presented as `Authorization: Bearer <key>` or `x-api-key: <key>`, never in the URL.
A request carrying two `Authorization` (or two `x-api-key`) headers is ambiguous and holds no
valid key: proxies disagree on which one counts, so the gateway takes neither. Keys are
compared as SHA-256 digests (equal length whatever was sent) in constant time against every
configured key, with no early exit. Callers without a key own their requests per client
address (`anonymous@<ip>`), so with inference open one stranger still cannot abort
another's. Inference keys may carry limits of requests per second and prompt tokens per
minute (gateway/admission/key_limits.py; buckets exist only for configured keys, so their number is
bounded).

A page in a browser is a stranger even on loopback: every admin and abort request, once its
caller is known, passes `browser.BrowserGuard` (Host, Sec-Fetch-Site, Origin, JSON content
type), here, so that no route can forget it.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import hmac
import ipaddress
from dataclasses import dataclass

from gateway.admission.browser import BrowserGuard
from gateway.admission.key_limits import KeyLimits
from gateway.errors import Forbidden, Unauthorized

ANONYMOUS = "anonymous"  # the tenant of callers without a key


class Role(enum.Enum):
    PUBLIC = "public"
    INFERENCE = "inference"
    ADMIN = "admin"

    # members are singletons: the identity hash (in C) instead of Enum's Python-level
    # hash of the name, asked on every request by `role in caller.roles`
    __hash__ = object.__hash__


ADMIN_TENANT = "admin"  # the tenant of admin callers (their aborts, flushes...)
# plain module names for the members (on Python 3.11 `Role.ADMIN` is a ~170 ns lookup)
PUBLIC, INFERENCE, ADMIN = Role.PUBLIC, Role.INFERENCE, Role.ADMIN
_PUBLIC = frozenset({PUBLIC})
_PUBLIC_INFERENCE = frozenset({PUBLIC, INFERENCE})


@dataclass(slots=True, eq=False)
class Caller:
    """The authenticated caller of one request (never changed once made; not frozen, which
    would make every request pay a frozen __init__)."""

    roles: frozenset[Role]  # what its credentials grant (PUBLIC always)
    key_id: str | None  # "inference:3" / "admin:0"; None without a key
    loopback: bool
    address: str = ""  # the client's IP address as the socket says (no forwarded headers)
    key_index: int | None = None  # which inference key (its per-key limits)
    tenant: str = ANONYMOUS  # whose usage this is: the key's tenant (configured), else this

    @property
    def owner(self) -> str:
        """Who owns the requests this caller makes (for abort): its key, else its address."""
        return self.key_id or f"anonymous@{self.address}"

    @property
    def is_admin(self) -> bool:
        return ADMIN in self.roles


def is_loopback(client: tuple | None) -> bool:
    return bool(client) and _loopback_host(str(client[0]))


@functools.lru_cache(maxsize=4096)
def _loopback_host(host: str) -> bool:
    """Cached: parsing the address was 1.5% of a request's CPU; few hosts call a gateway."""
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


AMBIGUOUS = "\x00ambiguous"  # never a configured key: config refuses non-printable keys


def presented_key(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The key a request carries: `Authorization: Bearer` first, then `x-api-key`;
    `AMBIGUOUS` when either header comes twice."""
    bearer = api_key = None
    authorizations = api_keys = 0
    for name, value in headers:
        if name == b"authorization":
            authorizations += 1
            if value[:7].lower() == b"bearer ":
                bearer = value[7:].strip(b" \t").decode("latin-1")
        elif name == b"x-api-key":
            api_keys += 1
            api_key = value.strip(b" \t").decode("latin-1")
    if authorizations > 1 or api_keys > 1:
        return AMBIGUOUS
    return bearer if bearer is not None else api_key


def digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class _KeySet:
    """Constant-time membership over a fixed list of keys: the candidate's digest is compared
    with every key's digest (32 bytes each, so neither length nor content leaks)."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        self.keys = [digest(k.encode()) for k in keys]

    def index(self, candidate: bytes) -> int:
        wanted = digest(candidate)
        found = -1
        for index, key in enumerate(self.keys):  # no early exit: constant time over keys
            if hmac.compare_digest(wanted, key):
                found = index
        return found


class Auth:
    """Identifies callers and enforces the role a route needs."""

    def __init__(self, inference_keys: tuple[str, ...], admin_keys: tuple[str, ...],
                 limits: KeyLimits | None = None, tenants: tuple[str, ...] = (),
                 hosts: tuple[str, ...] = ()) -> None:
        self.inference = _KeySet(inference_keys)
        self.admin = _KeySet(admin_keys)
        self.limits = limits or KeyLimits(len(inference_keys))
        if len(tenants) != len(inference_keys):
            tenants = ("default",) * len(inference_keys)
        self.tenants = tenants  # the tenant of each inference key
        self._keyless_callers: dict[str, Caller] = {}
        self.browser = BrowserGuard(hosts)  # `hosts`: the names this gateway answers to

    @property
    def inference_open(self) -> bool:
        return not self.inference.keys

    @property
    def admin_keys_set(self) -> bool:
        return bool(self.admin.keys)

    def caller(self, scope: dict, needed: Role | tuple[Role, ...]) -> Caller:
        """The caller of `scope`, or an error if it lacks role `needed` (a tuple: the first
        of those roles it has, else the error of the last one). A route that needs the admin
        role, or takes it as one of its roles (abort), also refuses pages in browsers."""
        caller = self._identify(scope, needed)
        if needed is ADMIN or (needed.__class__ is tuple and ADMIN in needed):
            # trusted for being on this host (no admin key exists, it presented no valid
            # key): a DNS-rebinding page is on this host too, so its Host must name the gateway
            self.browser.check(scope, caller.loopback and caller.key_id is None
                               and not self.admin_keys_set)
        return caller

    def _identify(self, scope: dict, needed: Role | tuple[Role, ...]) -> Caller:
        if isinstance(needed, tuple):
            for role in needed[:-1]:
                try:
                    return self._identify(scope, role)
                except (Unauthorized, Forbidden):
                    continue
            needed = needed[-1]
        client = scope.get("client")
        keys = self.inference.keys or self.admin.keys  # none: every caller is keyless
        key = presented_key(scope["headers"]) if keys else None
        if key is not None:
            address = str(client[0]) if client else ""
            caller = self._by_key(key, is_loopback(client), address, needed)
        else:
            caller = self._keyless(client)
        if needed in caller.roles:
            return caller
        loopback, address = caller.loopback, caller.address
        if needed is ADMIN:
            if not self.admin_keys_set and loopback:
                return Caller(caller.roles | {ADMIN}, caller.key_id, loopback,
                              address)  # the operator on the host
            if caller.key_id is not None:
                raise Forbidden("this API key has no admin rights")
            if not self.admin_keys_set:
                raise Forbidden("the admin API answers only loopback clients until admin keys "
                                "are configured (--admin-api-key-file or GATEWAY_ADMIN_API_KEYS)")
        if caller.key_id is not None:
            raise Unauthorized("this API key is not an inference key")
        raise Unauthorized("missing API key (Authorization: Bearer <key>)")

    def _keyless(self, client: tuple | None) -> Caller:
        """The caller without a key at this address: one per address, made once (a caller is
        never changed; the set of keys is fixed for the life of this object)."""
        address = str(client[0]) if client else ""
        caller = self._keyless_callers.get(address)
        if caller is None:
            if len(self._keyless_callers) >= 4096:  # bounded: many addresses, start over
                self._keyless_callers.clear()
            caller = self._keyless_callers[address] = Caller(self._open, None,
                                                             is_loopback(client), address)
        return caller

    @property
    def _open(self) -> frozenset[Role]:
        """What a caller without a key may do."""
        return _PUBLIC_INFERENCE if self.inference_open else _PUBLIC

    def _by_key(self, key: str, loopback: bool, address: str, needed: Role) -> Caller:
        if key == AMBIGUOUS:
            if needed is PUBLIC:
                return Caller(_PUBLIC, None, loopback, address)
            raise Unauthorized("several Authorization or x-api-key headers; send one key")
        candidate = key.encode("latin-1")
        admin = self.admin.index(candidate)
        inference = self.inference.index(candidate)
        if admin >= 0:
            return Caller(self._open | {ADMIN}, f"admin:{admin}", loopback, address,
                          tenant=ADMIN_TENANT)
        if inference >= 0:
            if needed is INFERENCE:
                self.limits.take_request(inference)
            return Caller(_PUBLIC_INFERENCE, f"inference:{inference}", loopback, address,
                          key_index=inference, tenant=self.tenants[inference])
        if needed is PUBLIC or (needed is INFERENCE and self.inference_open):
            # an unknown key where none is needed (OpenAI clients always send one)
            return Caller(self._open, None, loopback, address)
        raise Unauthorized("invalid API key")

    def describe(self) -> str:
        """One line for the startup log."""
        inference = "open (no keys)" if self.inference_open else f"{len(self.inference.keys)} keys"
        admin = (f"{len(self.admin.keys)} keys" if self.admin_keys_set
                 else "loopback clients only (no admin keys)")
        return f"inference: {inference}; admin: {admin}"
