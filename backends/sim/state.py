"""The parts one sim process owns, built once by the app's lifespan."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import httpx

from backends.sim.bootstrap import BootstrapClient
from backends.sim.config import SimConfig
from backends.sim.engine import Engine
from backends.sim.job import Job
from backends.sim.kv_events import KvEventPublisher
from backends.sim.metrics import Telemetry
from backends.sim.radix import RadixCache
from backends.sim.rooms import RoomRegistry
from backends.sim.stats import SimStats


@dataclass
class SimState:
    config: SimConfig
    cache: RadixCache
    engine: Engine
    stats: SimStats
    telemetry: Telemetry
    registry: RoomRegistry | None = None
    client: BootstrapClient | None = None
    http: httpx.AsyncClient | None = None
    publisher: KvEventPublisher | None = None
    rng: random.Random = field(default_factory=random.Random)
    started: float = field(default_factory=time.monotonic)
    jobs: dict[str, tuple[Job, asyncio.Task[None]]] = field(default_factory=dict)
    decode_rooms: set[int] = field(default_factory=set)
    generation_requests: int = 0

    @classmethod
    def build(cls, config: SimConfig) -> SimState:
        """Create every component; sockets and tasks start in `start()`."""
        events_on = config.kv_events is not None and config.kv_events.enabled
        cache = RadixCache(config.page_size, config.cache_capacity_tokens, record_events=events_on)
        state = cls(
            config=config, cache=cache, engine=Engine(config, cache), stats=SimStats(),
            telemetry=Telemetry(config), rng=random.Random(config.seed),
        )
        if events_on and config.kv_events is not None:
            state.publisher = KvEventPublisher(config.kv_events, config.page_size,
                                               config.kv_events_encoding)
            cache.on_events = state.publisher.publish
        if config.mode == "prefill":
            state.registry = RoomRegistry(open_ttl=2 * max(config.bootstrap_timeout,
                                                           config.waiting_timeout) + 60)
        return state

    async def start(self) -> None:
        self.engine.start()
        if self.publisher is not None:
            self.publisher.start_replay()
        if self.config.mode == "decode":
            self.http = httpx.AsyncClient(
                timeout=httpx.Timeout(5.0, connect=2.0),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
                trust_env=False,
            )
            self.client = BootstrapClient(self.config, self.http)

    async def stop(self) -> None:
        for _, task in list(self.jobs.values()):
            task.cancel()
        await self.engine.stop()
        if self.http is not None:
            await self.http.aclose()
        if self.publisher is not None:
            self.publisher.close()

    @property
    def ready(self) -> bool:
        """Health: not failing on purpose and past the simulated slow start."""
        faults = self.config.faults
        if faults.health_fail:
            return False
        return time.monotonic() - self.started >= faults.slow_start
