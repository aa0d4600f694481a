"""build_app(config) -> ASGI app: one table of paths with the role each needs, and a lifespan
that owns the parts.

Every path the gateway answers is a row of `ROUTES` (path, methods, handler, role). The three
inference paths are pure-ASGI endpoints reached without Starlette's router (a measurable share
of a small request's CPU); they check the caller themselves with the same `Auth`. Everything
else goes through Starlette with the role checked by `guarded` before the handler runs.

A handler gets the request and its module's parts (`RouteParts`, built once from the
`Gateway` here), never the gateway itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.admission.auth import ADMIN, INFERENCE, PUBLIC, Auth, Role
from gateway.admission.body_budget import BodyBudget
from gateway.anthropic.endpoint import messages_endpoints
from gateway.config.settings import GatewayConfig
from gateway.errors import GatewayError
from gateway.reach import LOGIT_PROCESSOR, MEDIA_URLS
from gateway.request import ENDPOINT_PATHS, RESPONSES
from gateway.responses import stored
from gateway.responses.endpoint import ResponsesEndpoint
from gateway.responses.service import Responses, build_responses
from gateway.responses.view import parse_responses
from gateway.routes import admin, dashboard, info, models, operations, role_switch
from gateway.routes.admin import AdminParts
from gateway.routes.dashboard import DashboardParts
from gateway.routes.errors import HANDLERS, json_error
from gateway.routes.fleet import Fleet
from gateway.routes.inference import InferenceEndpoint, InferenceParts
from gateway.routes.info import InfoParts
from gateway.routes.operations import OperationParts
from gateway.routes.role_switch import RoleSwitchParts
from gateway.runtime import Gateway
from gateway.servers.rebalance import for_gateway

Handler = Callable[[Request, Any], Awaitable[Response]]
Endpoint = Callable[[Request], Awaitable[Response]]


# Either role will do, admin first so that an admin key is recognised as one (an inference key
# never becomes admin): an admin aborts anyone's requests (or all), an inference caller its
# own; an admin reads the servers' addresses in /server_info, a caller only their facts.
EITHER = (ADMIN, INFERENCE)
ROUTES: list[tuple[str, tuple[str, ...], Handler, Role | tuple[Role, ...]]] = [
    ("/health", ("GET",), info.health, PUBLIC),
    ("/readiness", ("GET",), info.readiness, PUBLIC),
    ("/health_generate", ("GET",), info.health_generate, PUBLIC),
    ("/metrics", ("GET",), info.metrics, PUBLIC),
    ("/dashboard", ("GET",), dashboard.page, PUBLIC),
    ("/v1/models", ("GET",), models.list_models, INFERENCE),
    ("/v1/models/{model:path}", ("GET",), models.model_card, INFERENCE),
    ("/model_info", ("GET",), models.model_info, INFERENCE),
    ("/get_model_info", ("GET",), models.model_info, INFERENCE),
    ("/server_info", ("GET",), info.server_info, EITHER),
    ("/get_server_info", ("GET",), info.server_info, EITHER),
    ("/v1/tokenize", ("POST",), operations.relay, INFERENCE),
    ("/v1/detokenize", ("POST",), operations.relay, INFERENCE),
    ("/tokenize", ("POST",), operations.relay, INFERENCE),
    ("/detokenize", ("POST",), operations.relay, INFERENCE),
    ("/abort_request", ("POST",), operations.abort_request, EITHER),
    ("/flush_cache", ("POST",), operations.broadcast, ADMIN),
    ("/start_profile", ("POST",), operations.broadcast, ADMIN),
    ("/stop_profile", ("POST",), operations.broadcast, ADMIN),
    ("/pause_generation", ("POST",), operations.broadcast, ADMIN),
    ("/continue_generation", ("POST",), operations.broadcast, ADMIN),
    ("/update_weights_from_disk", ("POST",), operations.update_weights, ADMIN),
    ("/admin/servers", ("GET",), admin.list_servers, ADMIN),
    ("/admin/servers", ("POST",), admin.add_server, ADMIN),
    ("/admin/servers", ("DELETE",), admin.remove_server, ADMIN),
    ("/admin/servers/drain", ("POST",), admin.drain_server, ADMIN),
    ("/admin/servers/undrain", ("POST",), admin.undrain_server, ADMIN),
    ("/admin/servers/role", ("POST",), role_switch.switch_role, ADMIN),
    ("/admin/policies", ("GET",), admin.list_policies, ADMIN),
    ("/admin/usage", ("GET",), admin.usage, ADMIN),
    ("/dashboard/data", ("GET",), dashboard.data, ADMIN),
    ("/v1/responses/{response_id}", ("GET",), stored.retrieve, INFERENCE),
    ("/v1/responses/{response_id}", ("DELETE",), stored.delete, INFERENCE),
    ("/v1/responses/{response_id}/cancel", ("POST",), stored.cancel, INFERENCE),
    ("/v1/responses/{response_id}/input_items", ("GET",), stored.input_items, INFERENCE),
]


@dataclass(frozen=True, slots=True)
class RouteParts:
    """The parts of each route module, by its name: a handler of `routes/<name>.py` gets
    `RouteParts.<name>`."""

    admin: AdminParts
    dashboard: DashboardParts
    info: InfoParts
    models: Fleet
    operations: OperationParts
    role_switch: RoleSwitchParts  # POST /admin/servers/role
    stored: Responses  # gateway/responses/stored.py

    def of(self, handler: Handler) -> Any:
        return getattr(self, handler.__module__.rsplit(".", 1)[1])


def route_parts(gw: Gateway, responses: Responses, bodies: BodyBudget) -> RouteParts:
    """Each route module's parts, taken from the gateway once; `bodies`: the in-flight body
    budget the inference endpoints charge, which the relayed routes charge too."""
    c = gw.config
    fleet = Fleet(gw.pool, gw.models, gw.client, c.probe_timeout, gw.info_caches)
    switch = role_switch.parts_of(gw)
    return RouteParts(
        admin=AdminParts(fleet, gw.scheduler, gw.tokens, gw.usage, gw.siblings, gw.register,
                         gw.unregister, gw.read_metrics, gw.learned_latency,
                         switch.switcher.parts.lock.switching),
        dashboard=DashboardParts(gw.pool, gw.models, gw.scheduler, gw.admission, gw.latency,
                                 gw.state, gw.read_metrics, gw.version, gw.rooms.replica_id),
        info=InfoParts(fleet, gw.state, gw.metrics, gw.probe_generation, gw.describe,
                       c.health_timeout),
        models=fleet,
        role_switch=switch,
        operations=OperationParts(fleet, gw.inflight, gw.aborts, gw.siblings,
                                  c.max_body_bytes, bodies),
        stored=responses)


def inference_parts(gw: Gateway) -> InferenceParts:
    c = gw.config
    return InferenceParts(
        auth=gw.auth, tenancy=gw.tenancy, models=gw.models, tokens=gw.tokens, limits=gw.limits,
        context=gw.context, inflight=gw.inflight, admission=gw.admission, usage=gw.usage,
        metrics=gw.metrics, timers=gw.timers, tracing=gw.tracing, state=gw.state,
        serve=gw.serve, max_body_bytes=c.max_body_bytes, max_items=c.max_items,
        bodies=BodyBudget(c.max_inflight_body_bytes, c.max_body_bytes), slo=gw.slo,
        allowed=frozenset(name for name, flag in ((MEDIA_URLS, c.allow_media_urls),
                                                  (LOGIT_PROCESSOR, c.allow_custom_logit_processor))
                          if flag))


def guarded(handler: Handler, role: Role | tuple[Role, ...], auth: Auth, parts: Any) -> Endpoint:
    """The handler behind the role check, given its parts; the caller is left in
    `request.state.caller`."""

    async def endpoint(request: Request) -> Response:
        request.state.caller = auth.caller(request.scope, role)
        try:
            return await handler(request, parts)
        except GatewayError as err:  # an admin is told the servers' addresses, a caller not
            if role is not ADMIN:
                raise
            return json_error(err, request.url.path, operator=True)

    endpoint.__name__ = handler.__name__
    return endpoint


class HotPaths:
    """Sends POSTs to the inference paths straight to their endpoints, skipping Starlette's
    middleware and router; everything else, lifespan included, goes through the Starlette app."""

    def __init__(self, app: Starlette, endpoints: dict[str, InferenceEndpoint]) -> None:
        self.app = app
        self.endpoints = endpoints
        self.state = app.state
        self.router = app.router

    def __call__(self, scope, receive, send) -> Awaitable[None]:
        """The endpoint's own coroutine, not one wrapping it: a streamed answer resumes every
        coroutine frame between the server and the relay once per event."""
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self.endpoints.get(scope["path"])
            if endpoint is not None:
                return endpoint(scope, receive, send)
        return self.app(scope, receive, send)


def _asgi3(method: Callable) -> Callable:
    """Mark `method` as a coroutine function for ASGI 3 detection (uvicorn's, Starlette's)."""
    mark = getattr(inspect, "markcoroutinefunction", None)  # Python 3.12+
    if mark is not None:
        return mark(method)
    method._is_coroutine = asyncio.coroutines._is_coroutine  # type: ignore[attr-defined]
    return method


HotPaths.__call__ = _asgi3(HotPaths.__call__)  # type: ignore[method-assign]


def build_routes(endpoints: dict[str, InferenceEndpoint], auth: Auth,
                 parts: RouteParts) -> list[Route]:
    routes = [Route(path, endpoint, methods=["POST"]) for path, endpoint in endpoints.items()]
    routes += [Route(path, guarded(handler, role, auth, parts.of(handler)),
                     methods=list(methods))
               for path, methods, handler, role in ROUTES]
    return routes


def build_app(config: GatewayConfig, transport: httpx.AsyncBaseTransport | None = None,
              worker=None) -> HotPaths:
    gateway = Gateway(config, transport, worker)
    responses = build_responses(gateway)  # /v1/responses state (gateway/responses/)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        gateway.starting = asyncio.ensure_future(gateway.start())  # SIGTERM may cancel it
        try:
            await gateway.starting
        except BaseException:  # failed, or stopped while starting: what started stops
            await gateway.stop()
            raise
        finally:
            gateway.starting = None
        await responses.start()
        rebalancer.start()  # --rebalance, and gateway_desired_servers (servers/rebalance.py)
        try:
            yield
        finally:
            await rebalancer.stop()
            await responses.stop()
            await gateway.stop()

    inference = inference_parts(gateway)
    endpoints = {path: InferenceEndpoint(inference, name)
                 for name, path in ENDPOINT_PATHS.items()}
    endpoints.update(messages_endpoints(inference, gateway))  # /v1/messages (gateway/anthropic/)
    endpoints["/v1/responses"] = ResponsesEndpoint(
        InferenceEndpoint(inference, RESPONSES, parse_responses), gateway.auth, responses,
        config.max_body_bytes, inference.bodies)
    parts = route_parts(gateway, responses, inference.bodies)
    rebalancer = for_gateway(gateway, parts.role_switch.switcher)
    routes = build_routes(endpoints, gateway.auth, parts)
    app = Starlette(routes=routes, exception_handlers=HANDLERS, lifespan=lifespan)
    # a path with a trailing slash is a 404 in the error shape, not a redirect to a URL built
    # from the client's own Host header (docs/SECURITY.md, "Paths")
    app.router.redirect_slashes = False
    app.state.gateway = gateway
    return HotPaths(app, endpoints)
