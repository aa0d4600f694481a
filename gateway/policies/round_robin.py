"""round_robin: each server in turn, skipping ones that are not candidates right now."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.policies.base import Policy
from gateway.request import RequestView
from gateway.servers.pool import Server


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self, role: str, options=None) -> None:
        super().__init__(role, options)
        self._counter = 0

    def pick(self, candidates: Sequence[Server], view: RequestView) -> Server:
        server = candidates[self._counter % len(candidates)]
        self._counter += 1
        return server
