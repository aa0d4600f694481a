"""The conversation a response continues, and the record kept of each response.

SGLang, when it keeps state itself, answers `previous_response_id` with the stored input
history of that response plus its output items, then the new input
(`OpenAIServingResponses._response_input_history`, and `msg_store[...] = history + output`
in `responses_full_generator`): `expand` builds exactly that list and sends it as `input`, so
a server never needs state, and any pair can serve the next turn. Instructions are not
carried over (OpenAI's rule; SGLang uses only the request's own).
"""

from __future__ import annotations

import time

import orjson

from gateway.errors import BadRequest, NotFound
from gateway.responses.view import input_items

TERMINAL = ("completed", "incomplete", "failed", "cancelled")
STOPPED = ("the gateway process serving this response stopped before it finished (its lease "
           "was not renewed)")


def parse_record(raw: bytes) -> dict:
    record = orjson.loads(raw)
    if not isinstance(record, dict):
        raise ValueError("a response record must be a JSON object")
    return record


def history_of(record: dict) -> list:
    """The whole conversation of a stored response: what it answered, then its output."""
    return list(record.get("input") or ()) + list(record.get("output") or ())


def expand(body: dict, previous: dict | None, rid: str) -> dict:
    """The body the servers get: the whole conversation as `input`, the gateway's response
    id as `rid`, and nothing that asks a server to keep state."""
    new = dict(body)
    items = input_items(body.get("input"))
    if previous is not None:
        if previous.get("status") not in ("completed", "incomplete"):
            error = (previous["response"].get("error") or {}).get("message")
            raise BadRequest(f"response '{previous['response'].get('id')}' is "
                             f"{previous.get('status')}{f' ({error})' if error else ''}; "
                             "only a completed or incomplete response can be continued",
                             code="previous_response_not_finished")
        items = history_of(previous) + items
    new["input"] = items
    new.pop("previous_response_id", None)
    new["store"] = False  # the gateway keeps the state; a server must not
    new["rid"] = rid
    return new


def not_found(rid: str) -> NotFound:
    err = NotFound(f"Response with id '{rid}' not found.", code="response_not_found")
    return err


def record_of(response: dict, items: list, status: str | None = None) -> bytes:
    """The stored record: the response, the whole input it answered, its output items."""
    return orjson.dumps({"status": status or response.get("status"), "input": items,
                         "output": response.get("output") or [], "response": response,
                         "written": time.time()})


def stopped(record: dict) -> dict:
    """An in_progress record whose lease lapsed, as it is read: failed, as OpenAI reports a
    response its server could not finish (status `failed`, `error.code` `server_error`)."""
    record["status"] = "failed"
    response = record["response"]
    response["status"] = "failed"
    response["error"] = {"code": "server_error", "message": STOPPED}
    return record


def placeholder(rid: str, body: dict, previous_id: str | None) -> dict:
    """The response of a request still running (GET shows it as in_progress)."""
    return {"id": rid, "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "model": body.get("model"), "output": [],
            "previous_response_id": previous_id, "store": True}
