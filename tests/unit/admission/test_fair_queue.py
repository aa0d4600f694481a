"""The fair queue's discipline, property-style: random workloads (seeded, so a failure
replays), each checked against the rule it must keep.

Rules: while tenants stay backlogged each gets service in proportion to its weight (within
a request or two); a backlogged tenant is served within a bound set by the weights (no
starvation); a tenant back from idle gets its share, not a burst for the time it was away;
within a tenant classes go in order and each class first come first served; shedding takes
the lowest class first, never one at or above the arrival's, and from the tenant holding
most of it per weight; removed waiters are never served.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

from gateway.admission.fair_queue import FairQueue

SEEDS = range(12)


def backlog(queue: FairQueue, weights: dict[str, float], per_tenant: int,
            rng: random.Random | None = None) -> None:
    ids = itertools.count()
    for _ in range(per_tenant):
        for tenant, weight in weights.items():
            klass = rng.randrange(3) if rng else 1
            queue.push(tenant, weight, klass, (tenant, klass, next(ids)))


@pytest.mark.parametrize("seed", SEEDS)
def test_backlogged_tenants_are_served_in_proportion_to_their_weights(seed):
    rng = random.Random(seed)
    weights = {f"t{i}": rng.choice((0.5, 1, 1, 2, 3, 8)) for i in range(rng.randint(2, 6))}
    queue = FairQueue()
    backlog(queue, weights, per_tenant=2000, rng=rng)
    total = sum(weights.values())
    served: Counter[str] = Counter()
    pops = 1000  # every tenant stays backlogged throughout (2000 queued each)
    for n in range(1, pops + 1):
        served[queue.pop()[0]] += 1
        for tenant, weight in weights.items():  # at every prefix, not only at the end
            assert abs(served[tenant] - n * weight / total) <= 2, (n, served, weights)


@pytest.mark.parametrize("seed", SEEDS)
def test_no_tenant_starves_however_small_its_weight(seed):
    rng = random.Random(seed)
    heavy = {f"heavy{i}": rng.choice((10, 50, 100)) for i in range(3)}
    queue = FairQueue()
    backlog(queue, heavy, per_tenant=3000)
    for _ in range(rng.randint(0, 500)):  # the heavy ones have been served a while
        queue.pop()
    queue.push("light", 1.0, 1, "light-request")
    bound = sum(heavy.values()) / 1.0 + len(heavy) + 1  # their services per light one
    for waited in itertools.count():
        if queue.pop() == "light-request":
            break
        assert waited <= bound, f"light waited {waited} pops (bound {bound})"


def test_idle_time_earns_no_credit():
    queue = FairQueue()
    backlog(queue, {"busy": 1.0}, per_tenant=500)
    for _ in range(400):  # only "busy" is served for a long time
        queue.pop()
    backlog(queue, {"returning": 1.0}, per_tenant=100)
    first = Counter(queue.pop()[0] for _ in range(40))
    assert abs(first["returning"] - first["busy"]) <= 2, first  # its share, not a burst


@pytest.mark.parametrize("seed", SEEDS)
def test_within_a_tenant_classes_go_in_order_and_fifo_within_a_class(seed):
    rng = random.Random(seed)
    queue = FairQueue()
    pending: dict[str, list[list[int]]] = {}
    for n in range(600):
        tenant = rng.choice(("a", "b", "c"))
        klass = rng.randrange(3)
        queue.push(tenant, {"a": 1, "b": 2, "c": 5}[tenant], klass, (tenant, klass, n))
        pending.setdefault(tenant, [[], [], []])[klass].append(n)
        if rng.random() < 0.4:
            tenant, klass, n = queue.pop()
            lanes = pending[tenant]
            best = next(k for k, lane in enumerate(lanes) if lane)
            assert klass == best, "a tenant's more urgent class waited"
            assert lanes[klass][0] == n, "not first come first served within the class"
            lanes[klass].pop(0)


def test_shedding_takes_the_lowest_class_from_the_biggest_holder_youngest_first():
    queue = FairQueue()
    for n in range(3):
        queue.push("flood", 1.0, 2, ("flood", 2, n))
    queue.push("small", 1.0, 2, ("small", 2, 0))
    queue.push("small", 1.0, 1, ("small", 1, 0))
    queue.push("other", 1.0, 0, ("other", 0, 0))
    assert queue.evict_below(0) == ("flood", 2, ("flood", 2, 2))  # youngest of the flooder
    assert queue.evict_below(0) == ("flood", 2, ("flood", 2, 1))
    assert queue.evict_below(1) in {("flood", 2, ("flood", 2, 0)), ("small", 2, ("small", 2, 0))}
    assert queue.evict_below(1)[1] == 2  # batch goes before standard...
    assert queue.evict_below(2) is None  # ...and nothing is shed for a batch arrival
    assert queue.evict_below(0) == ("small", 1, ("small", 1, 0))
    assert queue.evict_below(0) is None  # the interactive waiter is never shed for its class
    assert len(queue) == 1 and queue.pop() == ("other", 0, 0)


@pytest.mark.parametrize("seed", SEEDS)
def test_shedding_never_takes_the_arrivals_class_or_above(seed):
    rng = random.Random(seed)
    queue = FairQueue()
    for n in range(200):
        queue.push(rng.choice("xyz"), rng.choice((1, 3)), rng.randrange(3), n)
    while True:
        arrival = rng.randrange(3)
        before = list(queue.by_class)
        shed = queue.evict_below(arrival)
        if shed is None:
            assert not any(before[arrival + 1:]), "a lower class was left while refusing"
            if not len(queue) or arrival == 2:
                break
            continue
        lowest = max(k for k, count in enumerate(before) if count)
        assert shed[1] == lowest > arrival


@pytest.mark.parametrize("seed", SEEDS)
def test_removed_waiters_are_never_served_and_counts_stay_exact(seed):
    rng = random.Random(seed)
    queue = FairQueue()
    live: set = set()
    for n in range(1500):
        action = rng.random()
        if action < 0.5:
            item = (rng.choice("abcd"), rng.randrange(3), n)
            queue.push(item[0], {"a": 1, "b": 2, "c": 0.5, "d": 4}[item[0]], item[1], item)
            live.add(item)
        elif action < 0.75 and live:
            item = rng.choice(sorted(live))
            assert queue.remove(item[0], item[1], item)
            assert not queue.remove(item[0], item[1], item)  # twice: not queued any more
            live.discard(item)
        else:
            item = queue.pop()
            assert (item is None) == (not live)
            if item is not None:
                assert item in live
                live.discard(item)
        assert len(queue) == len(live) == sum(queue.by_class)
    assert len(queue._heap) <= 4 * 4 + len(live), "stale heap entries piled up"
