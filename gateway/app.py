"""build_app(config) -> Starlette: routes, error handlers and a lifespan that owns the parts."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import httpx
from starlette.applications import Starlette
from starlette.routing import Route

from gateway.config import GatewayConfig
from gateway.request import CHAT, COMPLETIONS, GENERATE
from gateway.routes import admin, dashboard, info
from gateway.routes.errors import HANDLERS
from gateway.routes.inference import InferenceEndpoint
from gateway.runtime import Gateway

INFERENCE_PATHS = {"/generate": GENERATE, "/v1/chat/completions": CHAT,
                   "/v1/completions": COMPLETIONS}


class HotPaths:
    """Sends POSTs to the inference paths straight to their endpoints, skipping Starlette's
    middleware and router (a measurable share of a small request's CPU); everything else,
    lifespan included, goes through the Starlette app."""

    def __init__(self, app: Starlette, endpoints: dict[str, InferenceEndpoint]) -> None:
        self.app = app
        self.endpoints = endpoints
        self.state = app.state
        self.router = app.router

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self.endpoints.get(scope["path"])
            if endpoint is not None:
                await endpoint(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_routes(endpoints: dict[str, InferenceEndpoint]) -> list[Route]:
    return [
        *(Route(path, endpoint, methods=["POST"]) for path, endpoint in endpoints.items()),
        Route("/v1/models", info.models, methods=["GET"]),
        Route("/model_info", info.model_info, methods=["GET"]),
        Route("/get_model_info", info.model_info, methods=["GET"]),
        Route("/server_info", info.server_info, methods=["GET"]),
        Route("/get_server_info", info.server_info, methods=["GET"]),
        Route("/health", info.health, methods=["GET"]),
        Route("/readiness", info.readiness, methods=["GET"]),
        Route("/health_generate", info.health_generate, methods=["GET"]),
        Route("/flush_cache", info.flush_cache, methods=["POST"]),
        Route("/abort_request", info.abort_request, methods=["POST"]),
        Route("/metrics", info.metrics, methods=["GET"]),
        Route("/admin/servers", admin.list_servers, methods=["GET"]),
        Route("/admin/servers", admin.add_server, methods=["POST"]),
        Route("/admin/servers", admin.remove_server, methods=["DELETE"]),
        Route("/admin/servers/drain", admin.drain_server, methods=["POST"]),
        Route("/admin/servers/undrain", admin.undrain_server, methods=["POST"]),
        Route("/admin/policies", admin.list_policies, methods=["GET"]),
        *dashboard.ROUTES,
    ]


def build_app(config: GatewayConfig,
              transport: httpx.AsyncBaseTransport | None = None) -> HotPaths:
    gateway = Gateway(config, transport)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    endpoints = {path: InferenceEndpoint(gateway, name) for path, name in INFERENCE_PATHS.items()}
    app = Starlette(routes=build_routes(endpoints), exception_handlers=HANDLERS,
                    lifespan=lifespan)
    app.state.gateway = gateway
    return HotPaths(app, endpoints)
