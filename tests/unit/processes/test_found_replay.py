"""What each worker's Kubernetes discovery added reaches a worker started again
(`processes/control_channel.py`, `Control.tell_found` and the hub's `found` replay): before,
the hub kept only admin changes, and a worker started again during an API outage served no
discovered server. Real socket pairs, one event loop playing the hub and the workers."""

from __future__ import annotations

import asyncio

from gateway.processes.control_channel import Hub
from tests.unit.processes.test_control_channel import Worker, admin, settle


def found(url: str, uid: str, role: str = "decode", **extra) -> dict:
    return {"op": "add", "url": url, "role": role, "bootstrap_port": None, "model": None,
            "pod": uid, "uid": uid, "draining": False, **extra}


def test_a_worker_started_again_gets_the_servers_discovery_has_with_the_operators_drain():
    async def main():
        hub = Hub()
        first, second = Worker(0), Worker(1)
        await first.join(hub)
        await second.join(hub)
        second.control.tell_found(found("http://b", "b-old"))
        await settle(lambda: "http://b" in hub._found)
        first.control.tell_found(found("http://a", "a", role="prefill"))
        first.control.tell_found(found("http://b", "b"))  # every worker tells: latest wins
        first.control.tell_found(found("http://gone", "gone"))
        first.control.tell_found({"op": "remove", "url": "http://gone"})  # its pod left
        first.control.tell_all(admin("drain", "http://b"))  # the operator drains b
        first.control.tell_found(found("http://c", "c"))
        first.control.tell_all(admin("remove", "http://c"))  # the operator's call since
        await settle(lambda: len(second.applied) == 2)
        assert second.control.found == {}  # not relayed live: each worker discovers itself

        hub.detach(1)
        successor = Worker(1)
        await successor.join(hub)
        await successor.control.synced(timeout=2)
        assert successor.control.found == {
            "http://a": found("http://a", "a", role="prefill"),
            "http://b": found("http://b", "b", draining=True),
        }
        for worker in (first, successor):
            await worker.control.stop()

    asyncio.run(main())
