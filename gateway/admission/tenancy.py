"""Whose a request is and how urgent: its tenant, priority class, deadline and session.

The tenant comes from the caller's API key (the key file's `KEY TENANT` lines; callers
without a key are the fixed tenant `anonymous`), never from a header, so tenant names (metric
labels) are bounded by the configuration. The class comes from the priority header
(`--priority-header`, default `x-priority`: `interactive`, `standard` or `batch`), lowered to
the tenant's `max_priority`, else the tenant's own `priority`. The deadline header
(`--deadline-header`, default `x-request-timeout`: seconds, as the client's own timeout) bounds
the request's wait for a slot and the request itself. The session header (`--session-header`,
off by default) names a conversation for session affinity (gateway/scheduling/affinity.py).

Cost: one pass over the request's headers, comparing each name with the (at most three)
configured ones; no allocation unless a header is present. A bad value is a 400 in the
OpenAI error shape, before the body is read.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Iterable
from typing import NamedTuple

from gateway.admission.auth import ANONYMOUS
from gateway.config.tenants import (
    ANY_TENANT,
    DEFAULT_SETTINGS,
    PRIORITIES,
    TenantSettings,
)
from gateway.errors import BadRequest

MAX_DEADLINE = 86400.0
SESSION_ID = re.compile(rb"[\x21-\x7e]{1,256}")  # visible ASCII, no spaces, at most 256 bytes
_CLASS_BY_NAME = {name.encode(): index for index, name in enumerate(PRIORITIES)}


class Ticket(NamedTuple):
    """What the headers said about one request, against its caller's tenant."""

    tenant: Tenant
    klass: int  # index into PRIORITIES
    deadline: float | None  # loop time, the client's own
    session: bytes | None


class Tenant:
    """One tenant's admission settings and its metric children (made on first use)."""

    __slots__ = ("name", "weight", "default", "ceiling", "admitted")

    def __init__(self, name: str, settings: TenantSettings) -> None:
        self.name = name
        self.weight = settings.weight
        self.default = settings.default_class  # class of a request naming none
        self.ceiling = settings.ceiling  # the most urgent class it may ask for
        self.admitted: list = [None] * len(PRIORITIES)  # BufferedCounter per class


def _header(name: str | None) -> bytes | None:
    return name.lower().encode("ascii") if name else None


class Tenancy:
    """The tenants of one gateway and the reading of the three tenancy headers."""

    def __init__(self, tenants: dict[str, TenantSettings] | None, key_tenants: Iterable[str],
                 priority_header: str | None = "x-priority",
                 deadline_header: str | None = "x-request-timeout",
                 session_header: str | None = None) -> None:
        settings = dict(tenants or {})
        fallback = settings.pop(ANY_TENANT, DEFAULT_SETTINGS)
        key_tenants = tuple(key_tenants)
        names = {ANONYMOUS, *key_tenants, *settings}
        self.tenants = {name: Tenant(name, settings.get(name, fallback)) for name in names}
        self.by_key = [self.tenants[name] for name in key_tenants]
        self.anonymous = self.tenants[ANONYMOUS]
        self.configured = bool(tenants)
        self._priority = _header(priority_header)
        self._deadline = _header(deadline_header)
        self._session = _header(session_header)
        self._any = bool(self._priority or self._deadline or self._session)

    def tenant_of(self, key_index: int | None) -> Tenant:
        """The tenant of inference key number `key_index` (None: no key, `anonymous`)."""
        return self.anonymous if key_index is None else self.by_key[key_index]

    def classify(self, headers: list[tuple[bytes, bytes]], key_index: int | None
                 ) -> Ticket:
        """(tenant, class, deadline in loop time or None, session id or None) of a request
        with these headers from the caller with inference key number `key_index`."""
        tenant = self.tenant_of(key_index)
        if not self._any:
            return Ticket(tenant, tenant.default, None, None)
        priority = deadline = session = None
        wanted_p, wanted_d, wanted_s = self._priority, self._deadline, self._session
        for name, value in headers:
            if name == wanted_p:
                priority = value
            elif name == wanted_d:
                deadline = value
            elif name == wanted_s:
                session = value
        klass = tenant.default if priority is None else max(self._class(priority),
                                                            tenant.ceiling)
        if deadline is not None:
            deadline = asyncio.get_running_loop().time() + self._seconds(deadline)
        if session is not None and SESSION_ID.fullmatch(session) is None:
            raise BadRequest(f"header {self._session.decode()!r} must be 1-256 visible ASCII "
                             "characters without spaces", code="invalid_header")
        return Ticket(tenant, klass, deadline, session)

    def _class(self, value: bytes) -> int:
        klass = _CLASS_BY_NAME.get(value.strip().lower())
        if klass is None:
            shown = value[:32].decode("latin-1")
            raise BadRequest(f"header {self._priority.decode()!r}: unknown priority class "
                             f"{shown!r}; one of {', '.join(PRIORITIES)}",
                             code="invalid_header")
        return klass

    def _seconds(self, value: bytes) -> float:
        try:
            seconds = float(value) if len(value) <= 32 else math.nan
        except ValueError:
            seconds = math.nan
        if not 0 < seconds <= MAX_DEADLINE:  # also NaN and inf
            raise BadRequest(f"header {self._deadline.decode()!r} must be the seconds the "
                             f"client waits, > 0 and <= {MAX_DEADLINE:g}",
                             code="invalid_header")
        return seconds
