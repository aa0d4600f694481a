"""A Responses turn prepared without a store write, and started when the servers are asked.

Until 2026-12-07 one call checked the body, expanded its history and wrote the in_progress
record, before the inference endpoint had checked anything: a request it then refused (the
key's rate, the model, the context, a full queue) left a `failed` record of up to the body
limit, so one key could fill the store's global byte limit, evicting every tenant's records,
without being served. Here the write waits for dispatch (`start`, called by the endpoint once
the inference endpoint asks the servers): a refused request writes nothing
(docs/SECURITY.md, "What a refused Responses request costs the store").
"""

from __future__ import annotations

import orjson

from gateway.dispatch.inflight import new_id
from gateway.errors import BadRequest
from gateway.request import json_object
from gateway.responses import history
from gateway.responses.service import REFUSED, Responses, Turn

ORJSON_DEPTH = 254  # the levels orjson writes; a deeper value raises JSONEncodeError
KEPT_DEPTH = ORJSON_DEPTH - 1  # a record holds the response (which echoes the request's
# fields) one level below its top, so a body is kept only a level short of orjson's limit


async def prepare(responses: Responses, tenant: str,
                  raw: bytes | bytearray) -> tuple[Turn, dict | None]:
    """The turn (the body checked, its history expanded and encoded) and, when it is to be
    kept, its in_progress response; nothing written, nothing running yet."""
    body = json_object(raw)
    for name, message in REFUSED.items():
        if body.get(name) not in (None, False):
            raise BadRequest(message, code=f"unsupported_{name}")
    store = body.get("store", True)
    if not isinstance(store, bool):
        raise BadRequest("'store' must be a boolean")
    previous_id = body.get("previous_response_id")
    previous = None
    if previous_id is not None:
        if not isinstance(previous_id, str) or not previous_id:
            raise BadRequest("'previous_response_id' must be a response id")
        previous = await responses.read(tenant, previous_id, "previous")
        if previous is None:
            raise history.not_found(previous_id)
    rid = "resp_" + new_id()
    new = history.expand(body, previous, rid)
    turn = Turn(rid, tenant, store, new["input"], encoded(new), previous_id)
    return turn, history.placeholder(rid, body, previous_id) if store else None


def encoded(body: dict) -> bytes:
    """The prepared body's bytes, or 400 when the store could not keep it. The chat path's
    one mechanism (dispatch/leg_bodies.py): orjson's own limit, its JSONEncodeError a 400.
    Encoded inside a list, one level down as the record holds it, then the brackets cut:
    the same bytes, no second encoding."""
    try:
        return orjson.dumps([body])[1:-1]
    except orjson.JSONEncodeError as exc:
        raise BadRequest(f"request body is nested too deeply: at most {KEPT_DEPTH} levels of "
                         f"JSON can be kept and forwarded ({exc})") from None


async def start(responses: Responses, turn: Turn, placeholder: dict | None) -> None:
    """The turn dispatched: its in_progress record written (when kept), and it is running
    here (its lease renewed, a cancel finds it)."""
    if placeholder is not None:
        await responses.keep(turn, placeholder, "start")
    responses.running[turn.rid] = turn
