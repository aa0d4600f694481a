"""With `--workers`, another worker answers an abort of a shared client id the way the
worker that got it does: a caller's abort reaches its own holders only; an admin's without
`owner` aborts nothing when several callers hold the id, and `owners` counts them first."""

from __future__ import annotations

import asyncio

from gateway.dispatch.inflight import InFlight, Tracked
from gateway.processes.siblings import Siblings


class Control:
    """The control channel: this worker's handlers, and the other worker's as `peer`."""

    def __init__(self) -> None:
        self.handlers, self.peer = {}, None

    def on(self, kind, handler) -> None:
        self.handlers[kind] = handler

    async def ask(self, msg: dict) -> list:
        return [await self.peer.handlers[msg["kind"]](msg)]


class Aborts:
    def __init__(self) -> None:
        self.hit: list[Tracked] = []

    async def abort(self, tracked: Tracked) -> list[dict]:
        self.hit.append(tracked)
        return [{"ok": True}]


def workers() -> tuple[Siblings, InFlight, Aborts]:
    """This worker's Siblings, and the table and aborts of the other worker it asks."""
    here, there = Control(), Control()
    here.peer, there.peer = there, here
    inflight, aborts = InFlight(), Aborts()
    Siblings(there, None, None, None, inflight, aborts)
    return Siblings(here, None, None, None, InFlight(), Aborts()), inflight, aborts


def test_a_caller_aborts_its_own_holders_in_another_worker_only():
    siblings, inflight, aborts = workers()
    alice, bob = Tracked("job-42", "inference:0"), Tracked("job-42", "inference:1")
    inflight.add(alice)
    inflight.add(bob)
    answer = asyncio.run(siblings.abort("job-42", "inference:1", False))
    assert answer["request_ids"] == ["job-42"] and aborts.hit == [bob]
    assert asyncio.run(siblings.abort("job-42", "inference:2", False)) is None
    assert asyncio.run(siblings.abort("job-42", "", False)) is None  # no owner: nothing
    assert aborts.hit == [bob]


def test_an_admin_abort_without_owner_of_a_shared_id_aborts_none_in_another_worker():
    siblings, inflight, aborts = workers()
    inflight.add(Tracked("job-42", "inference:0"))
    inflight.add(Tracked("job-42", "inference:1"))
    assert asyncio.run(siblings.owners("job-42", None)) == {"inference:0", "inference:1"}
    assert asyncio.run(siblings.owners("job-42", "inference:0")) == {"inference:0"}
    assert asyncio.run(siblings.abort("job-42", "", True)) is None
    assert aborts.hit == []
    answer = asyncio.run(siblings.abort("job-42", "inference:0", True))
    assert answer["request_ids"] == ["job-42"] and [t.owner for t in aborts.hit] == [
        "inference:0"]
