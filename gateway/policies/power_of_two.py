"""power_of_two: sample two candidates at random and take the less loaded one.

Cheaper than a full scan and, unlike least_load, robust to stale counters: a burst does not all
land on the one server that looked idle a moment ago. Both sampled workers are scored on the
same basis (server figures only if both are fresh; see `load.py`).
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.policies.base import Policy
from gateway.request import RequestView
from gateway.scheduling.load import LoadOptions, load_scores
from gateway.servers.pool import Server


@dataclass(frozen=True)
class PowerOfTwoOptions(LoadOptions):
    """Only the shared load-score options."""


class PowerOfTwoPolicy(Policy):
    name = "power_of_two"
    Options = PowerOfTwoOptions

    def __init__(self, role: str, options: PowerOfTwoOptions | None = None) -> None:
        super().__init__(role, options)
        self.rng = random.Random()  # replaceable, e.g. seeded in tests

    def pick(self, candidates: Sequence[Server], view: RequestView) -> Server:
        if len(candidates) == 1:
            return candidates[0]
        i, j = self.rng.sample(range(len(candidates)), 2)
        pair = (candidates[i], candidates[j])
        first, second = load_scores(pair, self.options, time.monotonic())
        return pair[1] if second < first else pair[0]
