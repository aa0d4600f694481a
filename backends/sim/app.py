"""Assembles the sim: the ASGI app, its lifespan, and the uvicorn server.

uvicorn runs with uvloop and httptools (a subclass of its protocol that sends
each response in one write: httpproto.py). POST /generate skips Starlette (see
`SimApp`); every other route is a Starlette route. A prefill sim also serves
its bootstrap port (bootstrap.py) from the same event loop, bound by the
lifespan before the HTTP port opens (one process per simulated server, so 16
fit on 2 cores).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import uvicorn
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from backends.sim import anthropic, info, native, openai, responses_api, role_switch, tokenize_api
from backends.sim.config import SimConfig
from backends.sim.httpproto import CoalescingHttpToolsProtocol
from backends.sim.state import SimState

_ROUTES = [
    Route("/generate", native.generate, methods=["POST", "PUT"]),
    Route("/v1/completions", openai.completions, methods=["POST"]),
    Route("/v1/chat/completions", openai.chat_completions, methods=["POST"]),
    Route("/v1/messages", anthropic.messages, methods=["POST"]),
    Route("/v1/messages/count_tokens", anthropic.count_tokens, methods=["POST"]),
    Route("/v1/responses", responses_api.responses, methods=["POST"]),
    Route("/abort_request", native.abort_request, methods=["POST"]),
    Route("/flush_cache", native.flush_cache, methods=["GET", "POST"]),
    Route("/pd_role_switch", role_switch.pd_role_switch, methods=["POST"]),
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
    Route("/v1/tokenize", tokenize_api.tokenize, methods=["POST"]),
    Route("/tokenize", tokenize_api.tokenize, methods=["POST"]),
    Route("/v1/detokenize", tokenize_api.detokenize, methods=["POST"]),
    Route("/detokenize", tokenize_api.detokenize, methods=["POST"]),
    Route("/metrics", info.metrics),
    Route("/sim/stats", info.sim_stats),
    Route("/sim/reset", info.sim_reset, methods=["POST"]),
    Route("/sim/faults", info.sim_faults, methods=["GET", "POST"]),
]


class SimApp:
    """The ASGI app: POST /generate goes straight to `native.generate_asgi`.

    /generate is the hot path of every PD benchmark; Starlette's routing,
    middleware and Request object cost more than the rest of a small request.
    The Starlette route stays for the fault knobs that must answer before
    the body is parsed (--error-rate, --hang, --crash-after).
    """

    def __init__(self, state: SimState, routes: Starlette) -> None:
        self.state = state
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and scope["path"] == "/generate"
                and scope["method"] in ("POST", "PUT") and not self._faulty()):
            await native.generate_asgi(self.state, scope, receive, send)
        else:
            await self.routes(scope, receive, send)

    def _faulty(self) -> bool:
        f = self.state.config.faults
        return bool(f.error_rate or f.hang or f.crash_after or f.fail_bootstrap_port
                    or f.truncate_rate or f.stall_after)


def build_app(state: SimState) -> SimApp:
    """The main app; its lifespan starts and stops the state's loops and sockets."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    routes = Starlette(routes=_ROUTES, lifespan=lifespan)
    routes.state.sim = state
    return SimApp(state, routes)


def uvicorn_config(app: SimApp, config: SimConfig) -> uvicorn.Config:
    return uvicorn.Config(
        app, host=config.host, port=config.port, loop="uvloop", http=CoalescingHttpToolsProtocol,
        lifespan="on", log_level=config.log_level, access_log=False, proxy_headers=False,
        timeout_keep_alive=30, backlog=4096, timeout_graceful_shutdown=1,
    )


def run(config: SimConfig) -> None:
    """Run until SIGINT/SIGTERM."""
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s sim %(message)s")
    state = SimState.build(config)
    uvicorn.Server(uvicorn_config(build_app(state), config)).run()
