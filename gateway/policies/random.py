"""random: uniform choice, the mini_lb baseline."""

from __future__ import annotations

import random as _random
from collections.abc import Sequence

from gateway.policies.base import Policy
from gateway.request import RequestView
from gateway.servers.pool import Worker


class RandomPolicy(Policy):
    name = "random"

    def pick(self, candidates: Sequence[Worker], view: RequestView) -> Worker:
        return candidates[_random.randrange(len(candidates))]
