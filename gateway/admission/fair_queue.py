"""The order in which waiting requests get a slot: weighted fair across tenants, by class
within a tenant. A plain data structure (no asyncio, no clock), so its discipline is tested
on its own (tests/unit/admission/test_fair_queue.py).

Across tenants: start-time fair queueing with virtual finish tags (as in SFQ/WF2Q, one unit
of cost per request). Each tenant with waiters ("a flow") has a start tag; the flow with the
smallest finish tag (start + 1/weight) is served next, the virtual clock moves to the served
flow's start tag, and that flow's start tag grows by 1/weight. A flow that had no waiters
starts at the clock: idle time earns no credit, so a tenant back from a pause gets its share,
not a burst; a flow never waits behind more than about `weight_others / weight_own` services
of the others per service of its own (no starvation across tenants).

Within a tenant: strict class order (interactive before standard before batch), first come
first served within a class. Each class of a flow is an OrderedDict used as an ordered set,
so leaving the queue (a timeout, a client gone) is O(1) and never leaves tombstones behind.

Shedding: `evict_below(klass)` takes a waiter of the LOWEST class below `klass` that has
any, from the tenant holding the most of that class per unit of weight (the flooder pays),
youngest first (it has waited least).
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from typing import Any


class _Flow:
    """One tenant's waiters, by class, with its fair-queueing tags."""

    __slots__ = ("name", "weight", "classes", "size", "start", "version", "entry")

    def __init__(self, name: str, weight: float, classes: int) -> None:
        self.name = name
        self.weight = weight
        self.classes: tuple[OrderedDict, ...] = tuple(OrderedDict() for _ in range(classes))
        self.size = 0
        self.start = 0.0  # virtual start tag of its next service
        self.version = 0  # which heap entry is current (older ones are skipped)
        self.entry: float | None = None  # the key of its current heap entry, if one is there


class FairQueue:
    """Waiters (any hashable items) queued per tenant and class."""

    def __init__(self, classes: int = 3) -> None:
        self.classes = classes
        self._flows: dict[str, _Flow] = {}
        self._heap: list[tuple[float, int, int, _Flow]] = []
        self._order = itertools.count()
        self._clock = 0.0
        self.size = 0
        self.by_class = [0] * classes  # waiters per class, every tenant together

    def __len__(self) -> int:
        return self.size

    def push(self, tenant: str, weight: float, klass: int, item: Any) -> None:
        """Queue `item` of `tenant` in class `klass` (0 is served first)."""
        flow = self._flows.get(tenant)
        if flow is None:
            flow = self._flows[tenant] = _Flow(tenant, weight, self.classes)
        if flow.size == 0:
            flow.weight = weight
            flow.start = max(flow.start, self._clock)  # no credit for idle time
            if flow.entry != flow.start + 1.0 / weight:  # else its entry still stands
                self._schedule(flow)
        flow.classes[klass][item] = None
        flow.size += 1
        self.size += 1
        self.by_class[klass] += 1

    def pop(self) -> Any | None:
        """The next waiter to serve, or None if none waits."""
        heap = self._heap
        while heap:
            _, _, version, flow = heapq.heappop(heap)
            if version != flow.version:
                continue  # superseded by a later entry
            flow.entry = None
            if flow.size == 0:
                continue  # every waiter left
            klass = next(k for k, waiters in enumerate(flow.classes) if waiters)
            item, _ = flow.classes[klass].popitem(last=False)
            self._took(flow, klass)
            self._clock = max(self._clock, flow.start)
            flow.start += 1.0 / flow.weight
            if flow.size:
                self._schedule(flow)
            return item
        return None

    def remove(self, tenant: str, klass: int, item: Any) -> bool:
        """Take `item` out (it left the queue); False if it is not queued."""
        flow = self._flows.get(tenant)
        if flow is None or item not in flow.classes[klass]:
            return False
        del flow.classes[klass][item]
        self._took(flow, klass)
        return True

    def evict_below(self, klass: int) -> tuple[str, int, Any] | None:
        """(tenant, class, item) of the waiter to shed for an arrival of class `klass`: the
        lowest class below it that has waiters; None if every waiter is of `klass` or
        above."""
        for lower in range(self.classes - 1, klass, -1):
            if not self.by_class[lower]:
                continue
            flow = max((f for f in self._flows.values() if f.classes[lower]),
                       key=lambda f: len(f.classes[lower]) / f.weight)
            item, _ = flow.classes[lower].popitem(last=True)  # the youngest
            self._took(flow, lower)
            return flow.name, lower, item
        return None

    def waiting(self) -> dict[tuple[str, int], int]:
        """Waiters per (tenant, class), for the metrics."""
        return {(f.name, k): len(w) for f in self._flows.values()
                for k, w in enumerate(f.classes) if w}

    def heads(self, klass: int) -> list[Any]:
        """The oldest waiter of class `klass` of each tenant that has one."""
        return [next(iter(f.classes[klass])) for f in self._flows.values() if f.classes[klass]]

    def best_class(self) -> int | None:
        """The most urgent class that has a waiter."""
        for klass, count in enumerate(self.by_class):
            if count:
                return klass
        return None

    def _took(self, flow: _Flow, klass: int) -> None:
        flow.size -= 1
        self.size -= 1
        self.by_class[klass] -= 1

    def _schedule(self, flow: _Flow) -> None:
        flow.version += 1
        flow.entry = key = flow.start + 1.0 / flow.weight
        heapq.heappush(self._heap, (key, next(self._order), flow.version, flow))
