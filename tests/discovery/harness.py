"""Discovery against the fake API server, with a fake pool standing in for the gateway."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from gateway.discovery.kubeapi import KubeAPI
from gateway.discovery.kubernetes import KubernetesDiscovery
from gateway.servers.pool import Server
from tests.discovery.fakekube import FakeKube

SELECTORS = {"prefill": "app=sglang,role=prefill", "decode": "app=sglang,role=decode"}


class FakePool:
    """`on_add`/`on_remove` as the gateway's register/unregister behave, without probing."""

    def __init__(self) -> None:
        self.servers: dict[str, Server] = {}
        self.added: list[tuple[str, str, int | None]] = []
        self.removed: list[str] = []
        self.refuse: set[str] = set()

    async def add(self, url: str, role: str, bootstrap_port: int | None,
                  model: str | None = None) -> Server:
        if url in self.refuse:
            raise ValueError(f"{url} answers with another disaggregation mode")
        if url in self.servers:
            raise ValueError(f"{url} is already registered")
        server = Server(url, role, bootstrap_port, model=model)
        self.servers[url] = server
        self.added.append((url, role, bootstrap_port))
        return server

    def remove(self, url: str) -> Server | None:
        self.removed.append(url)
        return self.servers.pop(url, None)

    def urls(self, role: str | None = None) -> set[str]:
        return {u for u, w in self.servers.items() if role is None or w.role == role}


@contextlib.asynccontextmanager
async def discovering(*pods: dict, fake: FakeKube | None = None,
                      selectors: dict[str, str] | None = None, token_file: str | None = None,
                      sync: bool = True, **options) -> AsyncIterator[tuple]:
    """Start a fake API with `pods`, and discovery in front of it; yield (fake, pool, disc)."""
    fake = fake or FakeKube()
    await fake.start()
    for pod in pods:
        fake.add(pod)
    pool = FakePool()
    options = {"drain_poll": 0.02, "backoff_initial": 0.05, "backoff_max": 0.4, **options}
    discovery = KubernetesDiscovery(
        KubeAPI(fake.url, token_file=token_file), namespace="default",
        selectors=selectors or SELECTORS, on_add=pool.add, on_remove=pool.remove,
        holding=pool.servers.get, **options)
    await discovery.start()
    try:
        if sync:
            await asyncio.wait_for(discovery.wait_synced(), 5)
        yield fake, pool, discovery
    finally:
        await discovery.stop()
        await fake.stop()


async def eventually(check: Callable[[], object], timeout: float = 3.0,
                     what: str = "condition") -> None:
    """Poll until `check()` is true; fail after `timeout` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s")
        await asyncio.sleep(0.02)


def run(coro, timeout: float = 20.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def url(ip: str, port: int = 30000) -> str:
    return f"http://{ip}:{port}"
