"""The control channel between workers (`processes/control_channel.py`): admin changes are
applied in the order sent, and a worker attached later (one started again after a crash) gets
the latest admin change of each server before it serves. Real socket pairs, one event loop
playing the supervisor's hub and the workers."""

from __future__ import annotations

import asyncio
import socket

from gateway.processes.control_channel import Control, Hub
from gateway.processes.siblings import Siblings
from gateway.servers.pool import Server, ServerPool


class Worker:
    """A worker's end: its control and the admin changes it applied, in order."""

    def __init__(self, worker_id: int, slow_add: float = 0.0) -> None:
        self.id = worker_id
        self.applied: list[tuple[str, str]] = []
        self.slow_add = slow_add
        self.hub_end, theirs = socket.socketpair()
        self.control = Control(theirs, worker_id, 3)
        self.control.on("admin", self._apply)

    async def _apply(self, msg: dict) -> None:
        if msg["op"] == "add" and self.slow_add:
            await asyncio.sleep(self.slow_add)  # an add probes the server first
        self.applied.append((msg["op"], msg["url"]))

    async def join(self, hub: Hub) -> None:
        await hub.attach(self.id, self.hub_end)
        await self.control.start()


async def settle(condition, timeout: float = 2.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.005)


def admin(op: str, url: str, **extra) -> dict:
    return {"kind": "admin", "op": op, "url": url, **extra}


def test_a_worker_started_later_applies_the_latest_change_of_each_server_before_serving():
    async def main():
        hub = Hub()
        first, second = Worker(0), Worker(1)
        await first.join(hub)
        await second.join(hub)
        changes = [
            admin("add", "http://x", role="decode", bootstrap_port=None, model=None),
            admin("drain", "http://x"),
            admin("remove", "http://y"),  # a command-line server taken out
            admin("add", "http://z", role="decode", bootstrap_port=None, model=None),
            admin("remove", "http://z"),
            admin("drain", "http://w"),
            admin("undrain", "http://w"),
            admin("drain", "http://v"),
            admin("add", "http://v", role="prefill", bootstrap_port=9000, model=None),
            admin("drain", "http://b"),  # a failed role switch takes b out...
            admin("take_out", "http://b", why="restart required"),
            admin("undrain", "http://b"),  # ...and an undrain does not bring it back
        ]
        for change in changes:
            first.control.tell_all(change)
        await settle(lambda: len(second.applied) == len(changes))
        assert second.applied == [(c["op"], c["url"]) for c in changes]  # live, in order

        hub.detach(1)  # the second worker dies; its successor starts from the command line
        successor = Worker(1)
        await successor.join(hub)
        await successor.control.synced(timeout=2)
        assert successor.applied == [
            ("remove", "http://x"), ("add", "http://x"), ("drain", "http://x"),
            ("remove", "http://y"),
            ("remove", "http://z"),
            ("undrain", "http://w"),
            ("remove", "http://v"), ("add", "http://v"),  # added after its drain: afresh
            ("undrain", "http://b"), ("take_out", "http://b"),
        ]
        for worker in (first, successor):
            await worker.control.stop()

    asyncio.run(main())


def test_a_drain_told_right_after_an_add_is_applied_after_it():
    """An add awaits its probe; the drain that followed must not overtake it (it would find
    no server, and the server would be added undrained)."""
    async def main():
        hub = Hub()
        sender, receiver = Worker(0), Worker(1, slow_add=0.05)
        await sender.join(hub)
        await receiver.join(hub)
        sender.control.tell_all(admin("add", "http://x", role="decode"))
        sender.control.tell_all(admin("drain", "http://x"))
        await settle(lambda: len(receiver.applied) == 2)
        assert receiver.applied == [("add", "http://x"), ("drain", "http://x")]
        for worker in (sender, receiver):
            await worker.control.stop()

    asyncio.run(main())


def test_a_worker_without_its_replay_serves_after_the_timeout_instead_of_hanging(caplog):
    async def main():
        hub_end, theirs = socket.socketpair()  # nobody answers on the hub's end
        control = Control(theirs, 2, 3)
        await control.start()
        async with asyncio.timeout(2):
            await control.synced(timeout=0.05)
        await control.stop()
        hub_end.close()

    asyncio.run(main())
    assert "were not applied within" in caplog.text


def test_a_sibling_applies_a_take_out_and_an_undrain_keeps_the_server_out():
    pool = ServerPool()
    pool.add(Server("http://b", "decode", verified=True))
    siblings = Siblings(None, pool, register=None, unregister=pool.remove, inflight=None,
                        aborts=None)

    async def main():
        await siblings._apply(admin("take_out", "http://b", why="switch failed; restart"))
        await siblings._apply(admin("undrain", "http://b"))
    asyncio.run(main())
    server = pool.get("http://b")
    assert server.misconfigured == "switch failed; restart" and not server.serving
