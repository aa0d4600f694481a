"""The parts one sim process owns, built once by the app's lifespan."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from backends.sim.bootstrap import BootstrapServer
from backends.sim.config import DEFAULT_GRAPH_BS, SimConfig
from backends.sim.deadlines import DeadlineQueue
from backends.sim.dp import DpController, DpRank, build_ranks
from backends.sim.job import Job
from backends.sim.kvclient import BootstrapClient
from backends.sim.stats import SimStats
from backends.sim.telemetry import Telemetry


@dataclass
class SimState:
    config: SimConfig
    ranks: list[DpRank]  # one per DP rank (scheduler); usually one
    stats: SimStats
    telemetry: Telemetry
    controller: DpController | None = None  # only with more than one rank
    bootstrap: BootstrapServer | None = None
    bootstrap_deadlines: DeadlineQueue | None = None
    client: BootstrapClient | None = None
    rng: random.Random = field(default_factory=random.Random)
    started: float = field(default_factory=time.monotonic)
    jobs: dict[str, Job] = field(default_factory=dict)  # running items by rid
    generation_requests: int = 0
    # runtime role switch (role_switch.py): Scheduler._pd_role_switch_* and the decode
    # CUDA graph batch sizes captured so far (tp_worker.get_decode_cuda_graph_bs)
    pd_role_switch_unhealthy: bool = False
    pd_role_switch_in_progress: bool = False
    decode_graph_bs: list[int] = field(default_factory=list)
    role_switches: int = 0
    launch_mode: str = ""  # /server_info's disaggregation_mode: the launch configuration

    @classmethod
    def build(cls, config: SimConfig) -> SimState:
        """Create every component; sockets and tasks start in `start()`."""
        ranks = build_ranks(config, open_ttl=2 * max(config.bootstrap_timeout,
                                                     config.waiting_timeout) + 60)
        state = cls(config=config, ranks=ranks, stats=SimStats(), telemetry=Telemetry(config),
                    rng=random.Random(config.seed), launch_mode=config.mode)
        if len(ranks) > 1:
            state.controller = DpController(config, ranks)
        # start_disagg_service (managers/disagg_service.py): a prefill runs the bootstrap
        # server; with --enable-pd-role-switch every PD instance does, so one flipped to
        # prefill already has it (it is not rebuilt on a flip)
        if config.mode == "prefill" or (config.enable_pd_role_switch and config.mode != "null"):
            state.bootstrap = BootstrapServer(config, [r.registry for r in ranks if r.registry])
            state.bootstrap_deadlines = DeadlineQueue(config.bootstrap_timeout)
        if config.mode == "decode" and not config.disable_cuda_graph:
            state.decode_graph_bs = list(DEFAULT_GRAPH_BS)
        return state

    async def start(self) -> None:
        """Start the schedulers and bind the side sockets (before the HTTP port opens)."""
        for rank in self.ranks:
            rank.engine.start()
            if rank.publisher is not None:
                rank.publisher.start_replay()
        if self.bootstrap is not None:
            await self.bootstrap.start()
        if self.config.mode == "decode":
            self.client = BootstrapClient(self.config)

    async def stop(self) -> None:
        for job in list(self.jobs.values()):
            if job.task is not None:
                job.task.cancel()
        for rank in self.ranks:
            await rank.engine.stop()
        if self.bootstrap is not None:
            await self.bootstrap.stop()
        if self.bootstrap_deadlines is not None:
            self.bootstrap_deadlines.close()
        if self.client is not None:
            self.client.close()
        for rank in self.ranks:
            if rank.publisher is not None:
                rank.publisher.close()

    @property
    def ready(self) -> bool:
        """Health: not failing on purpose and past the simulated slow start."""
        faults = self.config.faults
        if faults.health_fail:
            return False
        return time.monotonic() - self.started >= faults.slow_start
