"""Assembles the sim: the HTTP app, its lifespan, and the uvicorn servers.

A prefill sim runs a second, tiny app on --bootstrap-port in the same event
loop (one process per simulated server, so 16 fit on 2 cores).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator

import uvicorn
from starlette.applications import Starlette
from starlette.routing import Route

from backends.sim import info, native, openai
from backends.sim.bootstrap import build_bootstrap_app
from backends.sim.config import SimConfig
from backends.sim.state import SimState

_ROUTES = [
    Route("/generate", native.generate, methods=["POST", "PUT"]),
    Route("/v1/completions", openai.completions, methods=["POST"]),
    Route("/v1/chat/completions", openai.chat_completions, methods=["POST"]),
    Route("/abort_request", native.abort_request, methods=["POST"]),
    Route("/flush_cache", native.flush_cache, methods=["GET", "POST"]),
    Route("/health", info.health),
    Route("/health_generate", info.health),
    Route("/ready", info.health),
    Route("/v1/models", info.models),
    Route("/v1/models/{model:path}", info.model_card),
    Route("/model_info", info.model_info),
    Route("/get_model_info", info.model_info),
    Route("/server_info", info.server_info),
    Route("/get_server_info", info.server_info),
    Route("/v1/loads", info.loads),
    Route("/metrics", info.metrics),
    Route("/sim/stats", info.sim_stats),
    Route("/sim/reset", info.sim_reset, methods=["POST"]),
    Route("/sim/faults", info.sim_faults, methods=["GET", "POST"]),
]


def build_app(state: SimState) -> Starlette:
    """The main app; its lifespan starts and stops the state's loops and sockets."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = Starlette(routes=_ROUTES, lifespan=lifespan)
    app.state.sim = state
    return app


class _QuietServer(uvicorn.Server):
    """A second server in the loop: the first one owns the signal handlers."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _uvicorn_config(app: Starlette, host: str, port: int, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(
        app, host=host, port=port, loop="uvloop", http="httptools", lifespan="auto",
        log_level=log_level, access_log=False, timeout_keep_alive=30, backlog=4096,
        timeout_graceful_shutdown=1,
    )


async def serve(config: SimConfig) -> None:
    """Run until SIGINT/SIGTERM."""
    state = SimState.build(config)
    main = uvicorn.Server(_uvicorn_config(build_app(state), config.host, config.port,
                                          config.log_level))
    extra: _QuietServer | None = None
    if config.mode == "prefill" and state.registry is not None:
        boot_app = build_bootstrap_app(config, state.registry)
        extra = _QuietServer(_uvicorn_config(boot_app, config.host, config.bootstrap_port,
                                             config.log_level))
    if extra is None:
        await main.serve()
        return
    boot_task = asyncio.ensure_future(extra.serve())
    try:
        await main.serve()
    finally:
        extra.should_exit = True
        await boot_task


def run(config: SimConfig) -> None:
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s sim %(message)s")
    import uvloop

    uvloop.run(serve(config))
