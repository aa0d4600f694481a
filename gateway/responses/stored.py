"""GET, DELETE and cancel of a kept response, answered by the gateway from its store.

Each looks under the caller's tenant only: another tenant's id is "not found", as is one past
its retention. A store that does not answer is 503 with Retry-After.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.responses import history, items
from gateway.responses.service import Responses
from gateway.responses.store import StoreDown


def _id(request: Request) -> str:
    return request.path_params["response_id"]


async def retrieve(request: Request, responses: Responses) -> Response:
    rid = _id(request)
    record = await responses.read(request.state.caller.tenant, rid, "get")
    if record is None:
        raise history.not_found(rid)
    response = record["response"]
    response["status"] = record.get("status") or response.get("status")
    return JSONResponse(response)


async def input_items(request: Request, responses: Responses) -> Response:
    """The whole input the response answered, one page of it as OpenAI lists it (items.py:
    typed, with ids, `order`, `limit` and `after` applied)."""
    rid = _id(request)
    record = await responses.read(request.state.caller.tenant, rid, "get")
    if record is None:
        raise history.not_found(rid)
    return JSONResponse(items.page(items.normalised(list(record.get("input") or ()), rid),
                                   request.query_params))


async def delete(request: Request, responses: Responses) -> Response:
    rid = _id(request)
    try:
        deleted = await responses.store.delete(request.state.caller.tenant, rid)
    except StoreDown:
        responses.errors.labels("delete").inc()
        raise
    if not deleted:
        raise history.not_found(rid)
    return JSONResponse({"id": rid, "object": "response", "deleted": True})


async def cancel(request: Request, responses: Responses) -> Response:
    rid = _id(request)
    response = await responses.cancel(request.state.caller.tenant, rid)
    if response is None:
        raise history.not_found(rid)
    return JSONResponse(response)
