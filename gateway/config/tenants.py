"""Priority classes and the per-tenant settings of the config (`tenants:`), checked by pydantic.

Three classes, served in this order within a tenant (docs/TENANCY.md):

| class | index | SGLang `priority` forwarded (higher first) |
|---|---|---|
| interactive | 0 | 20 |
| standard | 1 | 10 |
| batch | 2 | 0 |

The forwarded values are 10 apart, SGLang's default `--priority-scheduling-preemption-threshold`
(`managers/schedule_policy.py`: a waiting request preempts a running one only when its
priority is MORE than the threshold higher), so with SGLang's defaults interactive work may
preempt batch work, and neighbouring classes only reorder the server's queue.

A tenant's settings: `priority`, the class of its requests that name none; `max_priority`,
the highest class a request may ask for in the priority header (a higher ask is lowered to
it: a tenant cannot buy its way up); `weight`, its share of the gateway's slots when they
are scarce. The entry `"*"` stands for every tenant not listed (anonymous callers, keys
without a tenant); without it unlisted tenants get the defaults below.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

import pydantic
from pydantic import Field
from pydantic.dataclasses import dataclass

from gateway.config.servers import ConfigError

PRIORITIES = ("interactive", "standard", "batch")  # index = class; a lower index goes first
INTERACTIVE, STANDARD, BATCH = 0, 1, 2
SGLANG_VALUES = (20, 10, 0)  # the `priority` forwarded per class (SGLang: higher first)
ANY_TENANT = "*"
TENANT_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
HEADER_NAME = re.compile(r"[A-Za-z0-9\-]{1,64}")
RESERVED_HEADERS = frozenset({"authorization", "x-api-key", "x-request-id", "content-length",
                              "content-type", "host", "transfer-encoding"})

Priority = Literal["interactive", "standard", "batch"]


@dataclass(frozen=True, config=pydantic.ConfigDict(extra="forbid"))
class TenantSettings:
    """One tenant's admission settings (unknown keys are refused, naming the key)."""

    priority: Priority = "standard"
    max_priority: Priority = "interactive"
    weight: Annotated[float, Field(gt=0, le=1000)] = 1.0

    def __post_init__(self) -> None:
        if PRIORITIES.index(self.priority) < PRIORITIES.index(self.max_priority):
            raise ValueError(f"priority {self.priority!r} is above max_priority "
                             f"{self.max_priority!r}")

    @property
    def default_class(self) -> int:
        return PRIORITIES.index(self.priority)

    @property
    def ceiling(self) -> int:
        return PRIORITIES.index(self.max_priority)


DEFAULT_SETTINGS = TenantSettings()


def key_and_tenant(line: str, path: str) -> tuple[str, str]:
    """`KEY` or `KEY TENANT` (a key file's line); the tenant names the key in metrics and
    accounting, so it comes from configuration, never from clients."""
    parts = line.split()
    if len(parts) > 2 or (len(parts) == 2 and not TENANT_NAME.fullmatch(parts[1])):
        raise ConfigError(f"setting {path!r}: a line must be KEY or KEY TENANT, the tenant "
                          "1-64 characters of A-Z a-z 0-9 _ . -")
    return parts[0], parts[1] if len(parts) == 2 else "default"


def check_tenancy(cfg) -> None:
    """The tenancy settings that span fields: tenant names, and the three header names
    (distinct, and none a header the gateway reads for something else)."""
    for name in cfg.tenants or {}:
        if name != ANY_TENANT and not TENANT_NAME.fullmatch(name):
            raise ConfigError(f"setting 'tenants': bad tenant name {name!r} (1-64 characters "
                              "of A-Z a-z 0-9 _ . -, or '*' for every tenant not listed)")
    headers = {name: getattr(cfg, name) for name in ("priority_header", "deadline_header",
                                                      "session_header")}
    for name, value in headers.items():
        if value and not HEADER_NAME.fullmatch(value):
            raise ConfigError(f"setting {name!r}: {value!r} is not a header name (1-64 of "
                              "A-Z a-z 0-9 -)")
    named = [v.lower() for v in headers.values() if v]
    if len(set(named)) != len(named) or set(named) & RESERVED_HEADERS:
        raise ConfigError("settings 'priority_header', 'deadline_header' and "
                          "'session_header' must differ from each other and from the headers "
                          f"the gateway reads itself ({', '.join(sorted(RESERVED_HEADERS))})")


def forwarded_priority(server, klass: int, mode: str) -> int | None:
    """The `priority` a leg to `server` carries for class `klass` (None: no `priority`).

    `mode` is `--forward-priority`. auto: only to servers whose /server_info says
    `enable_priority_scheduling`: a server without it ignores the field, or, with
    `--abort-on-priority-when-disabled`, aborts the request with 503
    (`Scheduler._set_or_validate_priority`, managers/scheduler.py). The value's sign follows
    the server's `schedule_low_priority_values_first`."""
    if mode == "off" or (mode == "auto" and not server.priority_scheduling):
        return None
    value = SGLANG_VALUES[klass]
    return -value if server.low_priority_first else value


KEEP = object()  # with --forward-priority off: the body's `priority` passes as the client sent it


def set_priority(body: dict, value: int | object | None) -> None:
    """Put the gateway's `priority` in a leg's body; a client's own never reaches a server
    (it would jump other tenants' work there), unless forwarding is off (`KEEP`)."""
    if value is KEEP:
        return
    if value is None:
        body.pop("priority", None)
    else:
        body["priority"] = value
