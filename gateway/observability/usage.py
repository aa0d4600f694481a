"""Usage accounting per tenant and model: requests, errors, prompt tokens (cached and
uncached) and completion tokens, as Prometheus counters and as GET /admin/usage's JSON.

Why counters and not a store: Prometheus (or the access log, gateway/observability/access_log.py) keeps
the history; the gateway keeps running totals since it started, summed over `--workers`
processes by prometheus_client's multiprocess files like every other counter.

Where the figures come from (docs/TENANCY.md, "Usage accounting"):

* prompt tokens, split into cached and uncached: as each prefill server reports them in its
  own answer (`ledger.Ledger.prefill_answered`), counted when that answer arrives; every
  prefill a request caused counts (a retry after a failed decode, each sample of n > 1, the
  continuation of a resumed stream), so the tenants' sum equals the servers' sum
  (`gateway_prompt_tokens`);
* completion tokens: from the answer the client received (gateway/observability/answer_tokens.py);
  an OpenAI stream cut before its usage event, at least what its decode streams relayed
  (`RequestUsage.streams`, told by the relay as each ends; read only when needed);
* requests and errors: by the status the client got (499: the client left).

Labels are bounded: a tenant is a name from the key file (`KEY TENANT`), `default` (a key
without one), `anonymous` (no key) or `admin`; a model is the request's model as the
gateway resolves it (`models.Models.label`: a model's name, an alias counted under its
model, with one model every request under it), anything else `other`.

One `RequestUsage` per request travels on its `inflight.Tracked`; the request path touches
it with attribute writes and buffered counter increments only (gateway/observability/metric_buffer.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from gateway.admission.auth import ANONYMOUS
from gateway.observability.answer_tokens import (
    StreamTokens,
    completion_final,
    completion_total,
    relayed_tokens,
)
from gateway.request import CHAT, COMPLETIONS
from gateway.scheduling.models import OTHER

KINDS = ("cached", "uncached", "completion")
FIELDS = ("requests", "errors_4xx", "errors_5xx", "prompt_tokens", "cached_tokens",
          "uncached_tokens", "completion_tokens")


class _Children:
    """The buffered counters of one (tenant, model)."""

    __slots__ = ("requests", "errors_4xx", "errors_5xx", "cached", "uncached", "completion")

    def __init__(self, metrics, tenant: str, model: str) -> None:
        counter = metrics.buffered_counter
        self.requests = counter(metrics.tenant_requests.labels(tenant, model))
        self.errors_4xx = counter(metrics.tenant_errors.labels(tenant, model, "4xx"))
        self.errors_5xx = counter(metrics.tenant_errors.labels(tenant, model, "5xx"))
        self.cached = counter(metrics.tenant_tokens.labels(tenant, model, "cached"))
        self.uncached = counter(metrics.tenant_tokens.labels(tenant, model, "uncached"))
        self.completion = counter(metrics.tenant_tokens.labels(tenant, model, "completion"))


class RequestUsage:
    """One request's figures, written by the request path; what the access log shows.

    Finished when the client has its answer AND every prefill leg it started has ended (a
    prefill's answer may arrive after the decode's, gateway/dispatch/chores.py `finish_tail`)."""

    __slots__ = ("owner", "endpoint", "request_id", "time", "started", "tenant", "model",
                 "stream", "status", "ttft", "duration", "prompt", "cached",
                 "completion", "attempts", "retries", "failovers", "prefill", "decode",
                 "open_legs", "ended", "tail", "meter", "counters", "streams")

    def __init__(self, owner: Usage, endpoint: str, request_id: str, started: float) -> None:
        self.owner = owner
        self.endpoint = endpoint
        self.request_id = request_id
        self.time = time.time()
        self.started = started  # perf_counter at arrival
        self.tenant = ANONYMOUS
        self.model: str | None = None  # the label, fixed when the body is parsed
        self.stream = False
        self.status = 0
        self.ttft: float | None = None
        self.duration: float | None = None
        self.prompt: int | None = None
        self.cached: int | None = None
        self.completion: int | None = None
        self.attempts = 0
        self.retries = 0
        self.failovers = 0
        self.prefill: str | None = None
        self.decode: str | None = None
        self.open_legs = 0
        self.ended = False
        self.tail = b""  # the whole answer, or a stream's last two chunks
        self.meter: StreamTokens | None = None
        self.counters: _Children | None = None  # its (tenant, model)'s, once the body is parsed
        # an OpenAI stream's: (ended by itself, chunks, last events, capture) per decode
        # stream, appended by the relay as each ends (relay.StreamRelay._end); its events
        # carry no running count, so a stream cut before its usage event counts these
        # (`Usage.finish`, only then)
        self.streams: list | None = None

    # -- called by the request path ---------------------------------------------------------

    def dispatched(self, attempt) -> None:
        """An attempt starts on a pair (gateway/dispatch/proxy.py)."""
        self.attempts += 1
        self.open_legs += 1
        self.prefill, self.decode = attempt.prefill.url, attempt.decode.url

    def prefill_reported(self, prompt: int, cached: int) -> None:
        """A prefill server's answer said how many prompt tokens it had cached."""
        self.prompt = (self.prompt or 0) + prompt
        self.cached = (self.cached or 0) + cached
        children = self.counters or self.owner.children(self.tenant, self.model or OTHER)
        children.cached.pending += cached
        children.uncached.pending += max(0, prompt - cached)

    def prefill_settled(self) -> None:
        """A prefill leg ended (answered, failed or stopped)."""
        self.open_legs -= 1
        if self.ended and self.open_legs == 0:
            self.owner.log(self)


class Usage:
    """The accountant: labels, counters, the access log sink, the admin report."""

    def __init__(self, metrics, label: Callable[[str | None], str],
                 sink: Callable[[RequestUsage], None] | None = None) -> None:
        self.metrics = metrics
        self.label = label  # a request's `model` -> its model's label (models.Models.label)
        self.sink = sink  # the access log, if on
        self._children: dict[tuple[str, str], _Children] = {}

    def begin(self, endpoint: str, request_id: str, started: float) -> RequestUsage:
        return RequestUsage(self, endpoint, request_id, started)

    def parsed(self, record: RequestUsage, view) -> None:
        """The body is read: the request is counted under the model the gateway resolves its
        `model` to."""
        record.model = self.label(view.model)
        record.stream = view.stream
        if view.stream and (view.endpoint == CHAT or view.endpoint == COMPLETIONS):
            record.streams = []
        # the tenant is known before the body is read (routes/inference.py): its counters
        # are looked up once for the request's later figures
        record.counters = self.children(record.tenant, record.model)

    def children(self, tenant: str, model: str) -> _Children:
        key = (tenant, model)
        children = self._children.get(key)
        if children is None:
            children = self._children[key] = _Children(self.metrics, tenant, model)
        return children

    def finish(self, record: RequestUsage, status: int) -> None:
        """The client has its answer (or gave up): count the request and its completion."""
        record.status = status
        record.duration = time.perf_counter() - record.started
        if record.model is None:  # refused before its body was read
            record.model = self.label(None)
        meter = record.meter
        if meter is not None and meter.completion is not None:
            record.completion = meter.completion
        elif record.tail:
            tail = record.tail
            record.completion = completion_final(tail) if record.stream \
                else completion_total(tail)
        streams, record.tail, record.streams = record.streams, b"", None
        # cut before its usage event: what it got (a lone decode stream that ended by itself
        # passed its usage event on, if its server sends one: nothing was cut)
        if record.completion is None and streams and (len(streams) > 1 or not streams[0][0]):
            record.completion = 0
            for _, chunks, last, capture in streams:
                record.completion += relayed_tokens(record.endpoint, chunks, last, capture)
        children = record.counters or self.children(record.tenant, record.model)
        children.requests.pending += 1
        if status >= 500:
            children.errors_5xx.pending += 1
        elif status >= 400:
            children.errors_4xx.pending += 1
        if record.completion:
            children.completion.pending += record.completion
        record.ended = True
        if record.open_legs == 0:
            self.log(record)

    def log(self, record: RequestUsage) -> None:
        if self.sink is not None:
            self.sink(record)

    # -- the admin report -------------------------------------------------------------------

    def report(self, families: Iterable) -> dict:
        """Totals since start per tenant and model (summed over workers), from the registry's
        families; `errors` counts 4xx (499 included) and 5xx answers."""
        rows: dict[tuple[str, str], dict[str, float]] = {}

        def row(labels: dict) -> dict[str, float]:
            key = (labels.get("tenant", OTHER), labels.get("model", OTHER))
            found = rows.get(key)
            if found is None:
                found = rows[key] = dict.fromkeys(FIELDS, 0)
            return found

        for family in families:
            if family.name not in ("gateway_tenant_requests", "gateway_tenant_errors",
                                   "gateway_tenant_tokens"):
                continue
            for sample in family.samples:
                if not sample.name.endswith("_total"):
                    continue
                labels, value = sample.labels, sample.value
                if family.name == "gateway_tenant_requests":
                    row(labels)["requests"] += value
                elif family.name == "gateway_tenant_errors":
                    row(labels)["errors_" + labels.get("status_class", "5xx")] += value
                else:
                    row(labels)[labels.get("kind", "") + "_tokens"] += value
        tenants: dict[str, dict] = {}
        total = dict.fromkeys(FIELDS, 0)
        for (tenant, model), figures in sorted(rows.items()):
            figures["prompt_tokens"] = figures["cached_tokens"] + figures["uncached_tokens"]
            entry = tenants.setdefault(tenant, {"models": {}, "total": dict.fromkeys(FIELDS, 0)})
            entry["models"][model] = _ints(figures)
            for name in FIELDS:
                entry["total"][name] += figures[name]
                total[name] += figures[name]
        for entry in tenants.values():
            entry["total"] = _ints(entry["total"])
        return {"tenants": tenants, "total": _ints(total)}


def _ints(figures: dict[str, float]) -> dict[str, int]:
    """Counters hold floats; these are counts."""
    return {name: int(round(value)) for name, value in figures.items()}
