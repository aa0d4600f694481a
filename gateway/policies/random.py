"""random: uniform choice, the mini_lb baseline."""

from __future__ import annotations

import random as _random
from collections.abc import Sequence

from gateway.policies.base import Policy
from gateway.request import RequestView
from gateway.servers.pool import Server


class RandomPolicy(Policy):
    name = "random"

    def pick(self, candidates: Sequence[Server], view: RequestView) -> Server:
        return candidates[_random.randrange(len(candidates))]
