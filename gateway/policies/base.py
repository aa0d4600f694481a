"""The scheduling policy interface: candidates + request view -> one server.

A policy is synchronous and does no I/O in `pick`; candidates arrive already filtered
(usable: healthy, breaker closed, not draining; right model), never empty. Hooks let a policy
keep its own state; they default to no-ops. Policies that need a background loop (e.g. a KV
event subscriber) implement `start`/`stop`, which the app's lifespan calls.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from gateway.request import RequestView
from gateway.servers.pool import Server


@dataclass(frozen=True)
class NoOptions:
    """Options of a policy that takes none."""


class Policy:
    name: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    # True: give this policy the prompt's token ids whenever the served model's tokenizer is
    # loaded (gateway/tokens/prompt_tokens.py); tokenizing costs about a microsecond a token, so it
    # happens only for policies that match token ids exactly
    wants_token_ids: ClassVar[bool] = False
    # True: `pick_pair` writes its forecast on the SLO ticket of every request, one without
    # objectives too, and learns from how it ran (slo); the SLO gate then opens a ticket for
    # each request, else only for one that states an objective (slo/gate.py `ticket`)
    learns_from_every_request: ClassVar[bool] = False

    def __init__(self, role: str, options: Any = None) -> None:
        self.role = role
        self.options = options if options is not None else self.Options()

    @classmethod
    def inherited_options(cls, role: str) -> tuple[str, ...]:
        """Other policies whose `policy_options` also apply to this one in `role`, weakest
        first (its own come last): a policy built on others reads the options written for
        them (gateway/config/models.py)."""
        return ()

    def pick(self, candidates: Sequence[Server], view: RequestView) -> Server:
        raise NotImplementedError

    def pick_pair(self, prefills: Sequence, decodes: Sequence[Server], view: RequestView,
                  blocked: Any) -> tuple | None:
        """A prefill policy that chooses the (prefill target, decode) pair jointly returns
        it; None (the default): it picks the prefill alone and the decode policy the decode.
        `blocked(prefill_url, decode_url)` says whether a pair is quarantined."""
        return None

    def forecast(self, prefills: Sequence, decodes: Sequence[Server], view: RequestView,
                 blocked: Any = None) -> Any:
        """The best latency forecast any pair not `blocked` offers `view` now
        (gateway/slo/model.py's `Prediction`), for the SLO gate; None: this policy makes
        none."""
        return None

    def predicted_hit(self, server: Server, view: RequestView) -> float | None:
        """Fraction of the prompt this policy expects `server` to have cached, asked right
        after `pick` (for the predicted-vs-actual cache metric); None: no prediction."""
        return None

    def on_dispatch(self, server: Server, view: RequestView) -> None:
        """The request was sent to `server`."""

    def on_complete(self, server: Server, view: RequestView, success: bool) -> None:
        """The request on `server` finished (success False: it failed or was cancelled)."""

    def on_servers_changed(self, servers: Sequence[Server]) -> None:
        """Servers of this role were added or removed."""

    def share(self, prefixes: Any) -> None:
        """With `--workers N`: the table where every worker process records where it sent
        prompts (policies/shared_prefixes.py). Policies that keep no routing history ignore
        it."""

    async def start(self) -> None:
        """Start background work (called once by the app lifespan)."""

    async def stop(self) -> None:
        """Stop background work."""

    def stats(self) -> dict:
        """Policy-specific figures for the admin API and metrics."""
        return {}


def build_options(policy_cls: type[Policy], raw: dict | None) -> Any:
    """Typed options from a raw mapping; unknown keys or bad types fail, naming the key."""
    raw = raw or {}
    fields = {f.name: f for f in dataclasses.fields(policy_cls.Options)}
    for key in raw:
        if key not in fields:
            raise ValueError(
                f"policy {policy_cls.name!r}: unknown option {key!r} "
                f"(known: {', '.join(sorted(fields)) or 'none'})"
            )
    values = {}
    for key, value in raw.items():
        default = fields[key].default
        if isinstance(default, bool):
            ok = isinstance(value, bool)
        elif isinstance(default, (int, float)):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            value = type(default)(value) if ok else value
        else:
            ok = True
        if not ok:
            raise ValueError(f"policy {policy_cls.name!r}: option {key!r} has a bad value {value!r}")
        values[key] = value
    options = policy_cls.Options(**values)
    check = getattr(options, "validate", None)
    if check is not None:
        check()
    return options
