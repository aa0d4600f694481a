"""What each of the gateway's per-request mechanisms costs, as an upper bound: the mechanism
replaced by nothing for a measurement (`logic_cost --without NAME`), never for serving.

A stub keeps every request answered 200 (`logic_cost` raises otherwise) but drops what the
mechanism exists for: its accounting, its learning, its protection. So the difference it makes
is the most that making the mechanism cheaper could save, not a saving on offer; the stubs
overlap in places (`prefill_usage` includes the tenant's share of `usage`), so `all` is
measured, not summed. `python -m loadtests.mechanism_cost` prints the table;
docs/BENCHMARKS.md, "Where a request's CPU goes", has the figures.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from importlib import import_module


class _Sink:
    """A metric child that takes increments and keeps nothing."""

    pending = 0

    def inc(self, amount: float = 1) -> None:
        pass


_SINK = _Sink()


def _nothing(*_args, **_kwargs) -> None:
    return None


# name -> (what it stands for, [(module, attribute path, replacement)])
STUBS: dict[str, tuple[str, list[tuple[str, str, Callable]]]] = {
    "usage": ("per-tenant usage accounting (requests, tokens, errors by tenant and model)", [
        ("gateway.observability.usage", "Usage.parsed", _nothing),
        ("gateway.observability.usage", "Usage.finish", _nothing),
        ("gateway.observability.usage", "RequestUsage.dispatched", _nothing),
        ("gateway.observability.usage", "RequestUsage.prefill_reported", _nothing),
        ("gateway.observability.usage", "RequestUsage.prefill_settled", _nothing)]),
    "prefill_usage": ("the prefill answer's prompt and cached tokens (parsed, counted per "
                      "server and tenant)", [
        ("gateway.dispatch.ledger", "Ledger.prefill_answered", _nothing)]),
    "load_snapshots": ("settling the `/v1/loads` snapshots (ours that ended since a poll)", [
        ("gateway.dispatch.attempt", "Attempt.settle", _nothing),
        ("gateway.dispatch.attempt", "Attempt.settle_prefill", _nothing),
        ("gateway.dispatch.attempt", "Attempt.end_trail", _nothing)]),
    "queue_watch": ("the prefill queue watch that tells a queued attempt from a hung one", [
        ("gateway.dispatch.first_progress", "QueueWatch", _nothing)]),
    "learning": ("the latency model's learning (first progress, time per token)", [
        ("gateway.health.deadlines", "LatencyModel.first_progress", _nothing),
        ("gateway.dispatch.whole_body", "_learn", _nothing)]),
    "server_metrics": ("the per-server counters (decisions, predicted, prompt, cached)", [
        ("gateway.observability.metrics", "Metrics.child", lambda *_a, **_k: _SINK)]),
    "request_metrics": ("requests by status and the end-to-end latency histogram", [
        ("gateway.routes.inference", "InferenceEndpoint._count", _nothing)]),
    "pair_health": ("the pair's health (successes and probes)", [
        ("gateway.health.pairs", "PairHealth.record_success", _nothing),
        ("gateway.health.pairs", "PairHealth.release_probe", _nothing)]),
    "inflight": ("the in-flight table (abort and lookup by request id)", [
        ("gateway.dispatch.inflight", "InFlight.add", _nothing),
        ("gateway.dispatch.inflight", "InFlight.remove", _nothing)]),
    "shared_prefixes": ("with --workers: the shared prefix table (each prompt looked up and "
                        "recorded for the other workers)", [
        ("gateway.prefix.shared", "SharedPrefixes.find", _nothing),
        ("gateway.prefix.shared", "SharedPrefixes.record", _nothing)]),
    "shared_loads": ("with --workers: each server's in-flight figures published to and summed "
                     "from the shared block", [
        ("gateway.processes.shared_state", "ServerShare.publish", _nothing),
        ("gateway.processes.shared_state", "ServerShare.others", lambda *_a, **_k: (0, 0))]),
}
ALL = "all"


def names(spec: str) -> list[str]:
    """`a,b` or `all` -> the stub names (ValueError for an unknown one)."""
    chosen = [n.strip() for n in spec.split(",") if n.strip()]
    if ALL in chosen:
        return list(STUBS)
    unknown = [n for n in chosen if n not in STUBS]
    if unknown:
        raise ValueError(f"unknown mechanism(s) {unknown}; of {sorted(STUBS)} or {ALL}")
    return chosen


def resolve(module: str, path: str) -> tuple[object, str]:
    """The object holding `module`'s attribute `path` (dotted), and the attribute's name."""
    owner: object = import_module(module)
    *parents, attribute = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    if not hasattr(owner, attribute):  # a renamed target must fail loudly, not measure 0
        raise AttributeError(f"{module}.{path} no longer exists")
    return owner, attribute


@contextlib.contextmanager
def stubbed(chosen: list[str]) -> Iterator[None]:
    """The named mechanisms replaced by nothing while the block runs."""
    undo: list[tuple[object, str, object]] = []
    try:
        for name in chosen:
            for module, path, replacement in STUBS[name][1]:
                owner, attribute = resolve(module, path)
                undo.append((owner, attribute, getattr(owner, attribute)))
                setattr(owner, attribute, replacement)
        yield
    finally:
        for owner, attribute, original in reversed(undo):
            setattr(owner, attribute, original)
