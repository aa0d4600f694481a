"""Admin API (admin role, see gateway/admission/auth.py): servers with state and load; add,
remove and drain servers at runtime; the policies' figures.

    GET    /admin/servers                      every server with health, breaker, load
    POST   /admin/servers    {url, role, bootstrap_port?}
    DELETE /admin/servers    {url}             removes at once; in-flight requests finish
    POST   /admin/servers/drain {url, timeout?} no new work; answers when it is idle
    POST   /admin/servers/undrain {url}
    GET    /admin/policies                     each role's policy, options and own figures
    GET    /admin/usage                        requests, errors and tokens per tenant and
                                               model since start (gateway/observability/usage.py)

A server is added only once its `/server_info` answers a JSON object whose
`disaggregation_mode` is the role it is added as, so an unreachable or foreign URL (any HTTP
server answering 200 `{}` or HTML, the gateway itself) is refused rather than kept in the
pool; the URL must be exactly `http(s)://host[:port]` (no user, path, query or fragment).
Redirects are not followed. docs/SECURITY.md ("Admin API and SSRF").
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.config.servers import ConfigError, validate_url
from gateway.errors import BadRequest, GatewayError, NotFound
from gateway.observability.usage import Usage
from gateway.processes.siblings import Siblings
from gateway.routes.asgi import read_json
from gateway.routes.fleet import Fleet
from gateway.scheduling.scheduler import Scheduler
from gateway.servers.pool import ROLES, Server
from gateway.servers.probe import fetch_server_info, live_mode
from gateway.tokens.prompt_tokens import PromptTokens

MAX_DRAIN_WAIT = 3600.0
# scheme, then a DNS name, an IPv4 address or a bracketed IPv6 address, then an optional port
SERVER_URL = re.compile(r"https?://(?:[A-Za-z0-9.-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\])"
                        r"(?::[0-9]{1,5})?/?")


@dataclass(frozen=True, slots=True)
class AdminParts:
    """What the admin routes use; the callables are the gateway's own (register a server,
    read the metrics, what the hang deadlines learned of a server)."""

    fleet: Fleet
    scheduler: Scheduler
    tokens: PromptTokens
    usage: Usage
    siblings: Siblings  # tells the other --workers processes of a change
    register: Callable[..., Awaitable[Server]]
    unregister: Callable[[str], Server | None]
    read_metrics: Callable[[], list]
    learned_latency: Callable[[str], dict]
    switching: Callable[[str], bool]  # a role switch of this server runs (any worker)


async def list_servers(request: Request, parts: AdminParts) -> Response:
    models = parts.fleet.models
    servers = []
    for server in parts.fleet.pool:
        snapshot = server.snapshot()
        snapshot["learned_latency"] = parts.learned_latency(server.url)
        snapshot["model"] = models.name_of(server)  # the model it serves (None: not known yet)
        servers.append(snapshot)
    scheduler = parts.scheduler
    return JSONResponse({"servers": servers, "pairs": scheduler.pairs.snapshot(),
                         "panic_picks": dict(scheduler.panics)})


async def list_policies(request: Request, parts: AdminParts) -> Response:
    def described(policies: dict) -> dict:
        return {role: {"name": policy.name, "options": dataclasses.asdict(policy.options),
                       "stats": policy.stats()} for role, policy in policies.items()}

    models = parts.fleet.models
    body = described(parts.scheduler.policies)  # the default model's (the only one's)
    if not models.open:  # each model's own policies and state
        body["models"] = {m.name: described(m.policies) for m in models.known.values()}
    body["prompt_tokens"] = parts.tokens.stats()  # the tokenizer behind exact routing, if any
    return JSONResponse(body)


async def usage(request: Request, parts: AdminParts) -> Response:
    """The usage counters as JSON, summed over the worker processes (docs/TENANCY.md)."""
    return JSONResponse(parts.usage.report(parts.read_metrics()),
                        headers={"cache-control": "no-store"})


async def add_server(request: Request, parts: AdminParts) -> Response:
    body = await read_json(request)
    role = body.get("role")
    if role not in ROLES:
        raise BadRequest("'role' must be 'prefill' or 'decode'")
    raw = body.get("url")
    if not isinstance(raw, str) or SERVER_URL.fullmatch(raw) is None:
        raise BadRequest("'url' must be http(s)://host[:port] with nothing else (no user, "
                         "path, query or fragment)")
    try:
        url = validate_url(raw)
    except ConfigError as exc:
        raise BadRequest(str(exc)) from None
    port = body.get("bootstrap_port")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int)
                             or not 0 < port < 65536):
        raise BadRequest("'bootstrap_port' must be a port number")
    if parts.fleet.pool.get(url) is not None:
        raise GatewayError(f"{url} is already registered", status=409)
    _not_switching(parts, url)
    await _require_sglang(parts.fleet, url, role)
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise BadRequest("'model' must be a model name")
    async with parts.siblings.claimed(url):  # with --workers: 409 if another worker's add
        try:  # of it won (after the probe: docs/WORKERS.md, "One add per URL")
            server = await parts.register(url, role, port, require_probe=True, model=model)
        except ValueError:  # the same URL added by a call that probed it while this one did
            raise GatewayError(f"{url} is already registered", status=409) from None
        parts.siblings.admin_change("add", url, role=role, bootstrap_port=port,  # (the
                                    model=model)  # operator's: the others learn one)
    return JSONResponse({"server": server.snapshot()}, status_code=201)


async def _require_sglang(fleet: Fleet, url: str, role: str) -> None:
    """Refuse a URL whose /server_info does not name this PD role (startup lists may hold
    servers without a mode; the admin API, reachable by a stolen key, may not)."""
    try:
        info = await fetch_server_info(fleet.client, url, fleet.probe_timeout)
    except ConnectionError as exc:
        raise BadRequest(f"{url} did not answer as an SGLang {role} server: {exc}") from None
    mode = live_mode(info)  # after a role switch, not the launch mode
    if mode != role:
        raise BadRequest(f"{url} is not an SGLang {role} server (its /server_info says "
                         f"disaggregation_mode {str(mode)[:40]!r})")


def _server(fleet: Fleet, body: dict) -> Server:
    url = body.get("url")
    if not isinstance(url, str):
        raise BadRequest("'url' must be a server URL")
    server = fleet.pool.get(url.rstrip("/"))
    if server is None:
        raise NotFound(f"no server {url!r}")
    return server


def _not_switching(parts: AdminParts, url: str) -> None:
    """A server under a role switch is the switch's until it ends: a change made meanwhile
    would be undone by it (its put-back, its registration in the new role)."""
    if parts.switching(url):
        raise GatewayError(f"a role switch of {url} is in progress; try again once it ends",
                           status=409, code="role_switch_in_progress")


async def remove_server(request: Request, parts: AdminParts) -> Response:
    server = _server(parts.fleet, await read_json(request))
    _not_switching(parts, server.url)
    parts.unregister(server.url)
    parts.siblings.admin_change("remove", server.url)
    return JSONResponse({"removed": server.snapshot()})


async def drain_server(request: Request, parts: AdminParts) -> Response:
    body = await read_json(request)
    server = _server(parts.fleet, body)
    _not_switching(parts, server.url)
    timeout = body.get("timeout", 60)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
            or not 0 <= timeout <= MAX_DRAIN_WAIT:
        raise BadRequest(f"'timeout' must be a number of seconds in 0..{MAX_DRAIN_WAIT:g}")
    server.draining = True
    parts.siblings.admin_change("drain", server.url)
    deadline = time.monotonic() + timeout
    while server.totals()[0] > 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    idle = server.totals()[0] == 0
    return JSONResponse({"drained": idle, "server": server.snapshot()},
                        status_code=200 if idle else 202)


async def undrain_server(request: Request, parts: AdminParts) -> Response:
    server = _server(parts.fleet, await read_json(request))
    _not_switching(parts, server.url)
    server.draining = False
    parts.siblings.admin_change("undrain", server.url)
    return JSONResponse({"server": server.snapshot()})
