"""SGLang's HTTP surface beyond generation: tokenizer relays, abort, fleet-wide operations.

* `/v1/tokenize`, `/v1/detokenize` (and the unversioned aliases): relayed to one usable server
  of the model (every server of a model has the same tokenizer), body and answer as is.
* `/abort_request`: through the in-flight table (`gateway/dispatch/inflight.py`): a caller aborts
  its own requests by the id it was given (`x-request-id` or `meta_info.id`) or its own
  `rid` (every one of its requests holding it); an admin may abort any, or all
  (`abort_all`): an id several callers hold is 409 unless `owner` names one. Only `{"rid": ...}` or
  `{"abort_all": true}` ever reaches a server.
* Fleet operations, admin only, sent to every server with per-server results (as
  `/flush_cache`): `/flush_cache`, `/start_profile`, `/stop_profile`, `/pause_generation`,
  `/continue_generation`, `/update_weights_from_disk`. `?role=prefill|decode` and
  `?model=NAME` narrow the servers; with several models `/update_weights_from_disk` needs
  `?model=`. Every other SGLang operational endpoint (weight updates from tensors or
  distributed groups, LoRA loading, memory release, sessions, expert records, ...) is not
  relayed: each needs per-server arguments or coordination a broadcast cannot give
  (docs/SECURITY.md lists them).
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.admission.body_budget import BodyBudget
from gateway.dispatch.aborts import Aborts
from gateway.dispatch.inflight import InFlight
from gateway.errors import BadRequest, Forbidden, GatewayError, NotFound, ServiceUnavailable
from gateway.processes.siblings import Siblings
from gateway.routes.asgi import SMALL_BODY, read_json, read_json_raw
from gateway.routes.fleet import Fleet, post_all
from gateway.servers.pool import ROLES
from gateway.upstream.client import upstream_message


@dataclass(frozen=True, slots=True)
class OperationParts:
    fleet: Fleet
    inflight: InFlight
    aborts: Aborts
    siblings: Siblings  # the other --workers processes (an abort they hold)
    max_body_bytes: int
    bodies: BodyBudget  # a relayed body counts in flight like an inference one


async def relay(request: Request, parts: OperationParts) -> Response:
    """POST the body as is to the first usable server of its `model` that answers."""
    lease = parts.bodies.lease()
    try:
        raw, body = await read_json_raw(request, parts.max_body_bytes, lease)
        return await _relay(request, parts, raw, body)
    finally:
        lease.release()


async def _relay(request: Request, parts: OperationParts, raw: bytes, body: dict) -> Response:
    fleet = parts.fleet
    path = request.url.path
    last = "no usable server"
    model = body.get("model")
    model, _ = fleet.models.lookup(model if isinstance(model, str) else None)
    for server in model.usable("decode") + model.usable("prefill"):
        try:
            response = await fleet.client.post(server.url + path, content=raw,
                                               headers={"content-type": "application/json"},
                                               timeout=fleet.probe_timeout)
        except httpx.HTTPError as exc:
            last = f"{server.url}: {type(exc).__name__}"
            continue
        if response.status_code < 500:
            return Response(response.content, status_code=response.status_code,
                            media_type=response.headers.get("content-type", "application/json"))
        last = f"{server.url} answered {response.status_code}: {upstream_message(response.content)}"
    raise ServiceUnavailable(f"no server could answer {path}: {last}",
                             headers={"retry-after": "1"})


async def abort_request(request: Request, parts: OperationParts) -> Response:
    caller = request.state.caller
    body = await read_json(request)
    if body.get("abort_all") is True:
        if not caller.is_admin:
            raise Forbidden("'abort_all' needs an admin key")
        fleet = parts.fleet
        ok, results = await post_all(fleet, "/abort_request", b'{"abort_all": true}',
                                     list(fleet.pool))
        return JSONResponse({"success": ok, "results": results}, status_code=200 if ok else 502)
    rid = body.get("rid")
    if not isinstance(rid, str) or not rid or len(rid) > 256:
        raise BadRequest("'rid' must be the id of a request in flight (x-request-id, "
                         "meta_info.id or your own rid)")
    if not caller.is_admin:  # its own requests only: another caller's id never hides them
        return await _abort_of(parts, rid, caller.owner)
    owner = body.get("owner")
    if owner is not None and (not isinstance(owner, str) or not owner):
        raise BadRequest("'owner' must be the key id (inference:N) or anonymous@<address> "
                         "of the request's caller")
    owners = {t.owner for t in parts.inflight.holders(rid, owner)}
    owners |= await parts.siblings.owners(rid, owner)
    if len(owners) > 1:  # a client-chosen id several callers use: never guess which
        raise GatewayError(
            f"{len(owners)} callers have a request {rid!r} in flight "
            f"({', '.join(sorted(owners))}); none was aborted: add \"owner\" to choose one",
            status=409)
    return await _abort_of(parts, rid, owners.pop() if owners else "")


async def _abort_of(parts: OperationParts, rid: str, owner: str) -> Response:
    """Abort every request of `owner` holding `rid`, in this worker and the others."""
    held = parts.inflight.holders(rid, owner)
    results = [r for tracked in held for r in await parts.aborts.abort(tracked)]
    ids = [tracked.request_id for tracked in held]
    elsewhere = await parts.siblings.abort(rid, owner, False) if owner else None
    if elsewhere is not None:  # other worker processes held some
        ids += elsewhere["request_ids"]
        results += elsewhere["results"]
    if not ids:
        raise NotFound(f"no request {rid!r} of yours is in flight")
    return JSONResponse({"success": True, "request_id": ids[0], "request_ids": ids,
                         "results": results})


async def broadcast(request: Request, parts: OperationParts) -> Response:
    """The body to every server (of `?role=`, of `?model=`), with each one's result."""
    return await _broadcast(request, parts.fleet, one_model=False)


async def update_weights(request: Request, parts: OperationParts) -> Response:
    """As `broadcast`, but with several models `?model=` is required: one model's weights
    on another's servers would break them."""
    return await _broadcast(request, parts.fleet, one_model=True)


async def _broadcast(request: Request, fleet: Fleet, one_model: bool) -> Response:
    raw, _ = await read_json_raw(request, SMALL_BODY)  # relayed as sent: a JSON object
    role = request.query_params.get("role")
    if role is not None and role not in ROLES:
        raise BadRequest("'role' must be prefill or decode")
    servers = [w for w in fleet.pool if role is None or w.role == role]
    name = request.query_params.get("model")
    if name is not None:
        of_model = set(_model_servers(fleet, name))
        servers = [w for w in servers if w in of_model]
    elif one_model and not fleet.models.open:
        raise BadRequest(f"{request.url.path} with several models needs ?model=NAME: "
                         f"{', '.join(fleet.models.names())}")
    # the bytes as sent, not re-encoded: orjson reads 1,024 levels of nesting but writes 254,
    # and a deeper body was a plain-text 500 here (2026-12-07)
    ok, results = await post_all(fleet, request.url.path, bytes(raw) or b"{}", servers)
    return JSONResponse({"success": ok, "results": results}, status_code=200 if ok else 502)


def _model_servers(fleet: Fleet, name: str) -> list:
    """Every registered server of the model `name` (an alias resolves; unknown: 404)."""
    model, _ = fleet.models.lookup(name)
    return [w for ws in model.servers.values() for w in ws]
