"""least_load: the server with the lowest load score (see `load.py` for the score).

Ties rotate: with equal scores (an idle fleet, or identical counters) always taking the first
server would pile every burst onto it before the counters catch up.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.policies.base import Policy
from gateway.request import RequestView
from gateway.scheduling.load import LoadOptions, load_scores, rotating_argmin
from gateway.servers.pool import Server


@dataclass(frozen=True)
class LeastLoadOptions(LoadOptions):
    """Only the shared load-score options."""


class LeastLoadPolicy(Policy):
    name = "least_load"
    Options = LeastLoadOptions

    def __init__(self, role: str, options: LeastLoadOptions | None = None) -> None:
        super().__init__(role, options)
        self._turn = 0

    def pick(self, candidates: Sequence[Server], view: RequestView) -> Server:
        scores = load_scores(candidates, self.options, time.monotonic())
        index = rotating_argmin(scores, self._turn)
        self._turn += 1
        return candidates[index]
