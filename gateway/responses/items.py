"""GET /v1/responses/{id}/input_items: the kept input as OpenAI lists it.

The record keeps the input as the client sent it, and a client may send a message as
`{"role": "user", "content": "a"}`: no `type`, no `id`, its content a string. OpenAI's list
gives every item an `id` and a `type` (a role's item is a `"message"`, `status`
"completed", its content a list of parts: `input_text` for user, system and developer,
`output_text` for the assistant), and typed clients read them (the SDK's models had
`type=None, id=None` until 2026-12-07). So items are normalised on the way out; an id a
client's item lacks is made from the response id and the item's place, so it is the same
on every read (and `after` can name it). The page follows OpenAI's query: `order` (asc or
desc, default desc), `limit` (1 to 100, default 20), `after` (an item id); a bad value is a
JSON 400 in OpenAI's error shape.
"""

from __future__ import annotations

from collections.abc import Mapping

from gateway.errors import BadRequest

ORDERS = ("asc", "desc")
LIMIT, MAX_LIMIT = 20, 100


def normalised(items: list, rid: str) -> list[dict]:
    """The kept input items with an id each, a role's item a typed message."""
    base = rid.removeprefix("resp_")
    return [_item(item, f"msg_{base}_{i}") for i, item in enumerate(items)
            if isinstance(item, dict)]


def _item(item: dict, made_id: str) -> dict:
    out = dict(item)
    out.setdefault("id", made_id)
    role = out.get("role")
    if isinstance(role, str) and out.get("type", "message") == "message":
        out["type"] = "message"
        out.setdefault("status", "completed")
        content = out.get("content")
        if isinstance(content, str):
            kind = "output_text" if role == "assistant" else "input_text"
            out["content"] = [{"type": kind, "text": content}]
    return out


def page(items: list[dict], query: Mapping[str, str]) -> dict:
    """One page of `items` (oldest first) as OpenAI's list object, per `query`."""
    order = query.get("order", "desc")
    if order not in ORDERS:
        raise BadRequest(f"Invalid value for 'order': {order!r}; expected 'asc' or 'desc'.",
                         code="invalid_value")
    limit = _limit(query.get("limit"))
    ordered = items if order == "asc" else items[::-1]
    after = query.get("after")
    if after is not None:
        at = next((i for i, item in enumerate(ordered) if item.get("id") == after), None)
        if at is None:
            raise BadRequest(f"Invalid value for 'after': no input item with id {after!r}.",
                             code="invalid_value")
        ordered = ordered[at + 1:]
    data = ordered[:limit]
    return {"object": "list", "data": data, "has_more": len(ordered) > limit,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}


def _limit(raw: str | None) -> int:
    if raw is None:
        return LIMIT
    try:
        limit = int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIMIT:
        raise BadRequest(f"Invalid value for 'limit': {raw!r}; expected an integer from 1 "
                         f"to {MAX_LIMIT}.", code="invalid_value")
    return limit
