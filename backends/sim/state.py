"""The parts one sim process owns, built once by the app's lifespan."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from backends.sim.bootstrap import BootstrapServer
from backends.sim.config import SimConfig
from backends.sim.deadlines import DeadlineQueue
from backends.sim.engine import Engine
from backends.sim.job import Job
from backends.sim.kv_events import KvEventPublisher
from backends.sim.kvclient import BootstrapClient
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
    bootstrap: BootstrapServer | None = None
    bootstrap_deadlines: DeadlineQueue | None = None
    client: BootstrapClient | None = None
    publisher: KvEventPublisher | None = None
    rng: random.Random = field(default_factory=random.Random)
    started: float = field(default_factory=time.monotonic)
    jobs: dict[str, Job] = field(default_factory=dict)  # running items by rid
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
            state.bootstrap = BootstrapServer(config, state.registry)
            state.bootstrap_deadlines = DeadlineQueue(config.bootstrap_timeout)
        return state

    async def start(self) -> None:
        """Start the scheduler and bind the side sockets (before the HTTP port opens)."""
        self.engine.start()
        if self.publisher is not None:
            self.publisher.start_replay()
        if self.bootstrap is not None:
            await self.bootstrap.start()
        if self.config.mode == "decode":
            self.client = BootstrapClient(self.config)

    async def stop(self) -> None:
        for job in list(self.jobs.values()):
            if job.task is not None:
                job.task.cancel()
        await self.engine.stop()
        if self.bootstrap is not None:
            await self.bootstrap.stop()
        if self.bootstrap_deadlines is not None:
            self.bootstrap_deadlines.close()
        if self.client is not None:
            self.client.close()
        if self.publisher is not None:
            self.publisher.close()

    @property
    def ready(self) -> bool:
        """Health: not failing on purpose and past the simulated slow start."""
        faults = self.config.faults
        if faults.health_fail:
            return False
        return time.monotonic() - self.started >= faults.slow_start
