"""Several models behind one gateway: which servers serve which model, and which model a
request is for.

A server's model is, in this order: the name the operator gave it (the Kubernetes pod's model
label, a config file entry's `model`, the admin API's `model`), the `served_model_name` (else
`model_path`) its `/server_info` reports, `--model`, else SGLang's own `default`. A server
whose model is not known yet (it was unreachable at its probe) belongs to no model and takes
no request: it is not usable before a probe succeeds, and that probe names its model.

Each model is a `Model`: its servers per role and its own policy instances (its entry of
`--model-policies`, else the global policies), so its cache_aware tree, KV index and load
figures only ever hold its own servers, and a prefill is only ever paired with a decode of
its own model. A model's state stays when its last server leaves (a rollout brings new ones).

Which model a request is for (`resolve`, once per request after the body is parsed):

    a model's name                          that model
    an alias (--model-aliases)              its model; the body sent upstream names the model
    NAME:ADAPTER (SGLang's LoRA syntax)     NAME's model (an alias in NAME is rewritten)
    none, or "default"                      --default-model, else the only model, else 400
                                            `model_required` naming the models
    anything else, one model known          that model, `model` sent as is: lenient, as
                                            SGLang is (it serves whatever name is asked)
    anything else, several models known     404 `model_not_found`, OpenAI's shape

`open` (one model at most) is the single-pool gateway of old: status pages show no
per-model parts, and without aliases `resolve` returns the view itself (no allocation).

Known models: those with a registered server, plus every name the settings mention (a
request for one without servers gets 503, not 404). Lookups are dict lookups.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.config.models import DEFAULT_NAME
from gateway.errors import BadRequest, ModelNotFound
from gateway.policies import Policy
from gateway.redact import redact
from gateway.request import RequestView
from gateway.servers.pool import ROLES, Rank, Server, ServerPool

log = logging.getLogger("gateway.scheduling.models")

OTHER = "other"  # the usage label of a request of no known model


Target = Server | Rank


def targets(servers: list[Server]) -> list[Target]:
    """What the prefill policy chooses among: each server, or each of its DP ranks."""
    out: list[Target] = []
    for server in servers:
        if server.ranks:
            out.extend(server.ranks)
        else:
            out.append(server)
    return out


@dataclass(eq=False)
class Model:
    """One model: its servers by role and its own policies (own prefix state)."""

    name: str
    policies: dict[str, Policy]
    servers: dict[str, list[Server]] = field(
        default_factory=lambda: {role: [] for role in ROLES})

    def usable(self, role: str) -> list[Server]:
        return [w for w in self.servers[role] if w.usable]

    @property
    def registered(self) -> bool:
        return any(self.servers.values())

    def context_length(self) -> int | None:
        """The smallest context length its servers reported (they should agree)."""
        lengths = [w.context_length for ws in self.servers.values() for w in ws
                   if w.context_length]
        return min(lengths) if lengths else None


def describe(model: Model) -> str:
    return f"prefill {model.policies['prefill'].name}, decode {model.policies['decode'].name}"


class Models:
    def __init__(self, pool: ServerPool, make_policies: Callable[[str | None], dict[str, Policy]],
                 *, aliases: dict[str, str] | None = None, default: str | None = None,
                 configured: frozenset[str] = frozenset(), fallback: str | None = None) -> None:
        self.pool = pool
        self.aliases = dict(aliases or {})
        self.default_name = self.aliases.get(default, default) if default else None
        self.fallback = fallback or DEFAULT_NAME  # the model of servers that report none
        self._configured = configured
        self._make = make_policies
        self._models: dict[str, Model] = {}  # every model met or configured, state kept
        self.known: dict[str, Model] = {}  # the names a request may use, sorted
        self.open = True  # one model at most: every request is its
        self._none = Model("", make_policies(None))  # no model yet: nothing to pick from
        self.only: Model | None = self._none  # that one model while open
        self._owner: dict[Server, Model] = {}  # server -> its model, for the policy hooks
        self.unnamed = 0  # registered servers whose model is not known yet
        self._one_sided: set[str] = set()  # models with servers of one role (warned)
        self._started = False
        self._starting: set[asyncio.Task] = set()
        for name in configured:
            self._model(name)
        self.regroup()

    # -- membership (control path) -----------------------------------------------------------

    def name_of(self, server: Server) -> str | None:
        """The model a server serves; None while it is not known (not probed yet). A name
        that is a URL with a password (SGLang's served name defaults to the model path) has
        it redacted: names are listed to callers."""
        name = server.model or (self.fallback if server.verified else None)
        return redact(name) if name is not None and "@" in name else name

    def regroup(self) -> None:
        """Sort the pool's servers into their models and tell each model's policies."""
        members: dict[str, dict[str, list[Server]]] = {}
        unnamed = 0
        for server in self.pool:
            name = self.name_of(server)
            if name is None:
                unnamed += 1
                continue
            members.setdefault(name, {role: [] for role in ROLES})[server.role].append(server)
        owner: dict[Server, Model] = {}
        for name in sorted(members.keys() | self._models.keys()):
            model = self._model(name)
            model.servers = members.get(name) or {role: [] for role in ROLES}
            for server in (w for ws in model.servers.values() for w in ws):
                owner[server] = model
            model.policies["prefill"].on_servers_changed(targets(model.servers["prefill"]))
            model.policies["decode"].on_servers_changed(model.servers["decode"])
        self._owner = owner
        self.unnamed = unnamed
        self.known = {name: model for name, model in sorted(self._models.items())
                      if model.registered or name in self._configured}
        self.open = len(self.known) <= 1
        self.only = next(iter(self.known.values()), self._none) if self.open else None
        self._warn_one_sided()

    def _warn_one_sided(self) -> None:
        """Say so when a model has servers of one role only: often one model whose prefill
        and decode servers report different names (`--served-model-name` on one role only),
        which now makes two models that cannot serve."""
        one_sided = {name for name, model in self.known.items() if model.registered
                     and not (model.servers["prefill"] and model.servers["decode"])}
        for name in sorted(one_sided - self._one_sided):
            model = self.known[name]
            has, lacks = ("prefill", "decode") if model.servers["prefill"] else (
                "decode", "prefill")
            log.warning("model %s has %s servers but no %s server, so it cannot serve; if "
                        "they are one model, give both roles the same --served-model-name "
                        "(or name the model in the config); models: %s", name, has, lacks,
                        ", ".join(self.known))
        self._one_sided = one_sided

    def _model(self, name: str) -> Model:
        model = self._models.get(name)
        if model is None:
            model = self._models[name] = Model(name, self._make(name))
            if self._started:  # a model met at run time: its policies start now
                log.warning("model %s joins, with %s", name, describe(model))
                for policy in model.policies.values():
                    task = asyncio.get_running_loop().create_task(policy.start())
                    self._starting.add(task)
                    task.add_done_callback(self._starting.discard)
        return model

    async def start(self) -> None:
        """Start every model's policies (background loops such as KV event subscribers)."""
        self._started = True
        for model in list(self._models.values()):
            for policy in model.policies.values():
                await policy.start()

    async def stop(self) -> None:
        for task in list(self._starting):
            task.cancel()
        await asyncio.gather(*self._starting, return_exceptions=True)
        for model in list(self._models.values()):
            for policy in model.policies.values():
                await policy.stop()

    # -- requests (hot path) -----------------------------------------------------------------

    def resolve(self, view: RequestView) -> RequestView:
        """The view of the model it asks for (`view.model` its name from now on, but for a
        lenient single model); raises 404 or 400. One model, no aliases: the view itself."""
        if self.open and not self.aliases:
            return view
        model, upstream = self.lookup(view.model)
        if upstream is not None:
            return dataclasses.replace(view, model=model.name,
                                       body={**view.body, "model": upstream})
        if view.model != model.name and not self.open:
            return dataclasses.replace(view, model=model.name)
        return view

    def lookup(self, name: str | None) -> tuple[Model, str | None]:
        """The model `name` asks for, and the name the upstream body must carry instead
        (None: the body stays as sent)."""
        if name is None or (name == DEFAULT_NAME and name not in self.known):
            return self.default(), None
        model = self.known.get(name)
        if model is not None:
            return model, None
        target = self.aliases.get(name)
        if target is not None and target in self.known:
            return self.known[target], target
        cut = name.rfind(":")
        while cut > 0:  # NAME:ADAPTER, the longest NAME first (model names may hold ':')
            base, adapter = name[:cut], name[cut + 1:]
            if base in self.known:
                return self.known[base], None
            if self.aliases.get(base) in self.known:
                return self.known[self.aliases[base]], f"{self.aliases[base]}:{adapter}"
            cut = name.rfind(":", 0, cut)
        if self.only is not None:  # one model: any name is its (SGLang ignores the name)
            return self.only, None
        raise ModelNotFound(name, self.names(), self.unnamed)

    def label(self, name: str | None) -> str:
        """The model a request naming `name` is counted under (gateway/observability/usage.py): its
        model's name, else `other` (an unknown name, or none among several models): a
        label is never a client's free text."""
        if self.only is not None:  # one model: every name is its
            return self.only.name or OTHER
        try:
            model, _ = self.lookup(name)
        except (ModelNotFound, BadRequest):
            return OTHER
        return model.name or OTHER

    def default(self) -> Model:
        """The model of a request that names none."""
        if self.default_name is not None:
            return self.known.get(self.default_name) or self._none
        if self.only is not None:
            return self.only
        raise BadRequest(f"several models are served here; name one in 'model': "
                         f"{', '.join(self.names())}", code="model_required")

    def of(self, view: RequestView) -> Model:
        """The model of a resolved view (a view made inside the gateway is resolved here)."""
        return self.only or self.known.get(view.model) or self.lookup(view.model)[0]

    def policies_of(self, server: Server) -> dict[str, Policy]:
        """The policies of `server`'s model, by role: those that chose it and its partner
        (`Scheduler.pick` pairs servers of one model); their hooks go back to them."""
        model = self._owner.get(server)
        return (model or self._none).policies

    # -- for the info routes and status pages ------------------------------------------------

    def names(self) -> list[str]:
        return list(self.known)

    def listed(self) -> list[Model]:
        """The models with at least one registered server (what /v1/models lists)."""
        return [model for model in self.known.values() if model.registered]

    def shown(self) -> Model:
        """The model whose policies the status pages show first: the default, else the first."""
        if self.default_name in self.known:
            return self.known[self.default_name]
        return next(iter(self.known.values()), self._none)

    def ready(self) -> bool:
        """Some model has a usable prefill and a usable decode server."""
        return any(m.usable("prefill") and m.usable("decode") for m in self.known.values())
