"""A cancel racing a turn's final save: one wins the record, and the client, the cancel's
answer and the store agree on which (docs/RESPONSES.md, "Cancel racing the end of a
turn").

The interleaving is injected, not timed: the store runs the other party whole just before
the first party's first write, i.e. after whatever that party read. Before the conditional
write, each party read the record in_progress and then wrote over the other's.
"""

from __future__ import annotations

import asyncio

import orjson
import pytest
from prometheus_client import CollectorRegistry

from gateway.responses.endpoint import AnswerWatch
from gateway.responses.service import Responses
from gateway.responses.store import Retention, SQLiteStore


class HookedStore(SQLiteStore):
    """An in-memory store that runs `between` once, before the next write (put or swap)."""

    def __init__(self) -> None:
        super().__init__(None, Retention())
        self.between = None

    async def _hook(self) -> None:
        between, self.between = self.between, None
        if between is not None:
            await between()

    async def put(self, tenant: str, rid: str, record: bytes) -> None:
        await self._hook()
        await super().put(tenant, rid, record)

    async def swap(self, tenant: str, rid: str, expected: str, record: bytes) -> bool:
        await self._hook()
        return await super().swap(tenant, rid, expected, record)


class NotHere:
    """The in-flight table: the legs run elsewhere."""

    def find(self, rid: str) -> None:
        return None


class Siblings:
    """The `--workers` siblings: one of them runs every response; the aborts are noted."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    async def abort(self, rid: str, tenant: str, responses: bool) -> bool:
        self.aborted.append(rid)
        return True


async def _serving() -> tuple[Responses, HookedStore, Siblings]:
    store, siblings = HookedStore(), Siblings()
    responses = Responses(store, NotHere(), None, siblings, CollectorRegistry())
    await responses.start()
    return responses, store, siblings


async def _stored(store: SQLiteStore, rid: str) -> dict:
    return orjson.loads(await store.get("t", rid))


def _final(rid: str) -> dict:
    return {"id": rid, "object": "response", "status": "completed",
            "output": [{"type": "message", "content": [{"text": "made"}]}]}


@pytest.mark.parametrize("first, winner", [
    # the cancel runs whole before the final save writes: it wins
    pytest.param("save", "cancelled", id="cancel-between-the-saves-read-and-write"),
    # the final save runs whole before the cancel writes: the response finished first
    pytest.param("cancel", "completed", id="save-between-the-cancels-read-and-write"),
])
def test_one_wins_and_the_client_the_cancel_and_the_store_agree(first, winner):
    asyncio.run(_race(first, winner))


async def _race(first: str, winner: str) -> None:
    responses, store, siblings = await _serving()
    turn = await responses.begin("t", b'{"model": "m", "input": "hi"}')
    final, answered = _final(turn.rid), {}

    async def save() -> None:
        answered["saved"] = await responses.keep(turn, final)

    async def cancel() -> None:
        answered["cancel"] = await responses.cancel("t", turn.rid)

    store.between = cancel if first == "save" else save
    await (save() if first == "save" else cancel())
    record = await _stored(store, turn.rid)
    await responses.stop()
    assert final["status"] == winner  # what the client is sent
    assert answered["cancel"]["status"] == winner
    assert record["status"] == winner and record["response"]["status"] == winner
    assert answered["saved"] == winner
    assert record["output"] == final["output"]  # what was made is kept either way
    assert siblings.aborted == ([turn.rid] if winner == "cancelled" else [])


def _event(kind: str, response: dict) -> bytes:
    return (f"event: {kind}\n".encode() + b"data: "
            + orjson.dumps({"type": kind, "response": response}) + b"\n\n")


async def _answer_after_a_cancel(stream: bool) -> tuple[list[dict], dict, dict]:
    """A turn whose cancel won while its last event was on its way; what the client got."""
    responses, store, _ = await _serving()
    turn = await responses.begin("t", b'{"model": "m", "input": "hi", "stream": true}')
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    watch = AnswerWatch(responses, turn, send)
    kind = b"text/event-stream" if stream else b"application/json"
    await watch.send({"type": "http.response.start", "status": 200,
                      "headers": [(b"content-type", kind)]})
    if stream:
        await watch.send({"type": "http.response.body", "more_body": True,
                          "body": _event("response.created", {"id": turn.rid})})
    cancelled = await responses.cancel("t", turn.rid)
    last = _event("response.completed", _final(turn.rid)) if stream \
        else orjson.dumps(_final(turn.rid))
    half = len(last) // 2  # the final event cut in two chunks
    for part, more in ((last[:half], True), (last[half:], not stream)):
        await watch.send({"type": "http.response.body", "body": part, "more_body": more})
    if not stream:
        await watch.send({"type": "http.response.body", "body": b"", "more_body": False})
    record = await _stored(store, turn.rid)
    await responses.stop()
    return sent, cancelled, record


@pytest.mark.parametrize("stream", [pytest.param(True, id="stream"),
                                    pytest.param(False, id="whole-answer")])
def test_a_cancel_that_won_reaches_the_client_as_cancelled(stream):
    sent, cancelled, record = asyncio.run(_answer_after_a_cancel(stream))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    if stream:
        last = orjson.loads(body.rstrip().rsplit(b"\n", 1)[-1][len(b"data: "):])
        assert last["type"] == "response.completed"
        seen = last["response"]
    else:
        seen = orjson.loads(body)
        length = dict(sent[0]["headers"])[b"content-length"]
        assert int(length) == len(body)
    assert seen["status"] == cancelled["status"] == record["status"] == "cancelled"
    assert seen["output"] == record["output"] == _final(record["response"]["id"])["output"]
