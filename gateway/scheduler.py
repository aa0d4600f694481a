"""Pair selection: filter usable workers, then ask the prefill and decode policies.

A pair is chosen only when BOTH roles have a usable worker, so one leg is never sent alone.
On a retry the workers that just failed are avoided while others remain.
"""

from __future__ import annotations

from collections.abc import Collection

from gateway.errors import ServiceUnavailable
from gateway.policies import Policy
from gateway.request import RequestView
from gateway.workers import Worker, WorkerPool


class Scheduler:
    def __init__(self, pool: WorkerPool, prefill_policy: Policy, decode_policy: Policy) -> None:
        self.pool = pool
        self.policies = {"prefill": prefill_policy, "decode": decode_policy}
        pool.on_change(self.workers_changed)
        self.workers_changed()

    def workers_changed(self) -> None:
        """Tell the policies the current workers (membership or probed details changed)."""
        for role, policy in self.policies.items():
            policy.on_workers_changed(self.pool.role(role))

    def candidates(self, role: str, view: RequestView, avoid: Collection[Worker]) -> list[Worker]:
        workers = self.pool.usable(role)
        if view.model is not None:
            same_model = [w for w in workers if w.model == view.model]
            if same_model:
                workers = same_model
        if avoid:
            fresh = [w for w in workers if w not in avoid]
            if fresh:
                workers = fresh
        return workers

    def pick(self, view: RequestView, avoid: Collection[Worker] = (),
             prefer: tuple[Worker, int | None] | None = None) -> tuple[Worker, Worker]:
        """A (prefill, decode) pair; `prefer` names a prefill to take while it is a
        candidate (the samples of one request follow the first to its cached prompt)."""
        prefills = self.candidates("prefill", view, avoid)
        decodes = self.candidates("decode", view, avoid)
        if not prefills or not decodes:
            missing = " and ".join(
                role for role, found in (("prefill", prefills), ("decode", decodes)) if not found
            )
            raise ServiceUnavailable(
                f"no usable {missing} server (all down, draining or circuit-open)",
                headers={"retry-after": "1"},
            )
        if prefer is not None and prefer[0] in prefills:
            prefill = prefer[0]
        else:
            prefill = self.policies["prefill"].pick(prefills, view)
        decode = self.policies["decode"].pick(decodes, view)
        return prefill, decode

    def dispatched(self, prefill: Worker, decode: Worker, view: RequestView) -> None:
        self.policies["prefill"].on_dispatch(prefill, view)
        self.policies["decode"].on_dispatch(decode, view)

    def completed(self, role: str, worker: Worker, view: RequestView, success: bool) -> None:
        self.policies[role].on_complete(worker, view, success)
