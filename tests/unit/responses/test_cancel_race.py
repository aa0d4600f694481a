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
from tests.responses_turns import begin


class HookedStore(SQLiteStore):
    """An in-memory store that runs `between` once, before the next write (put or swap)."""

    def __init__(self) -> None:
        super().__init__(None, Retention())
        self.between = None

    async def _hook(self) -> None:
        between, self.between = self.between, None
        if between is not None:
            await between()

    async def put(self, tenant: str, rid: str, record: bytes, leased: bool = False) -> None:
        await self._hook()
        await super().put(tenant, rid, record, leased)

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

    def on_settle(self, settle) -> None:
        """No final save is pending in a sibling here."""

    async def settle(self, rid: str, tenant: str) -> bool:
        return False


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
    turn = await begin(responses, "t", b'{"model": "m", "input": "hi"}')
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


async def _answer_after_a_cancel(stream: bool, framed=None,
                                 cut=None) -> tuple[list[dict], dict, dict]:
    """A turn whose cancel won while its last event was on its way; what the client got.
    `framed(kind, response)`: the final event's bytes (`_event`'s by default), `cut(last)`:
    where a chunk ends inside it (its middle by default)."""
    responses, store, _ = await _serving()
    turn = await begin(responses, "t", b'{"model": "m", "input": "hi", "stream": true}')
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
    last = (framed or _event)("response.completed", _final(turn.rid)) if stream \
        else orjson.dumps(_final(turn.rid))
    half = (cut or (lambda data: len(data) // 2))(last)  # the final event cut in two chunks
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


def _pretty(end: bytes):
    """A proxy's framing: the data as indented JSON, one `data:` line per line (SSE joins
    them with "\n"), every line ended by `end`."""
    def framed(kind: str, response: dict) -> bytes:
        data = orjson.dumps({"type": kind, "response": response}, option=orjson.OPT_INDENT_2)
        lines = [b"event: " + kind.encode(), *(b"data: " + line for line in data.split(b"\n"))]
        return end.join(lines) + end + end
    return framed


def _one_line(end: bytes):
    return lambda kind, response: _event(kind, response).replace(b"\n", end)


def _client_events(body: bytes) -> list[dict]:
    """The JSON data of each event the client got, read as SSE reads it."""
    body = body.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    return [orjson.loads(b"\n".join(line[len(b"data:"):] for line in event.split(b"\n")
                                    if line.startswith(b"data:")))
            for event in body.split(b"\n\n") if b"data:" in event]


@pytest.mark.parametrize("framed", [
    pytest.param(_pretty(b"\n"), id="data-in-several-lines"),
    pytest.param(_pretty(b"\r\n"), id="data-in-several-lines-crlf"),
    pytest.param(_one_line(b"\r"), id="cr-line-ends"),
    pytest.param(_pretty(b"\r"), id="data-in-several-lines-cr"),
])
@pytest.mark.parametrize("cut", [pytest.param(lambda last: len(last) // 2, id="cut-inside"),
                                 pytest.param(lambda last: len(last) - 1, id="cut-in-the-end")])
def test_a_cancel_that_won_reaches_the_client_whatever_the_final_events_framing(framed, cut):
    sent, cancelled, record = asyncio.run(_answer_after_a_cancel(True, framed, cut))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    *_, last = _client_events(body)
    assert last["type"] == "response.completed"
    assert last["response"]["status"] == cancelled["status"] == record["status"] == "cancelled"
    assert last["response"]["output"] == record["output"]
