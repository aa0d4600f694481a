"""A Responses stream the decode cuts mid-way ends as SGLang ends a failing one: `event:
response.failed`, the next `sequence_number`, the response failed with `server_error` and the
gateway's message, no `[DONE]`; the turn's record says the same (until 2026-12-07 the client
got an untyped chat error event and `[DONE]`, and GET "the request ended without a response
(HTTP 200)"). A stream the client cut is recorded `cancelled` by the client, not failed."""

from __future__ import annotations

import asyncio

import httpx
import orjson

from tests.unit.fakes import FakeCluster, FakeServer, make_app, run, served_client

P1, D1 = "http://127.0.0.1:30000", "http://127.0.0.1:30001"
BODY = {"model": "m", "input": "hi", "stream": True}


def _event(kind: str, number: int, **fields) -> bytes:
    data = orjson.dumps({"type": kind, "sequence_number": number, **fields})
    return f"event: {kind}\n".encode() + b"data: " + data + b"\n\n"


def _opening() -> list[bytes]:
    response = {"id": "resp_sglang", "object": "response", "status": "in_progress",
                "model": "m", "output": []}
    return [_event("response.created", 0, response=response),
            _event("response.in_progress", 1, response=response),
            _event("response.output_text.delta", 2, item_id="msg_1", delta="Hel")]


def _cluster(tail: list[bytes]) -> FakeCluster:
    return FakeCluster({P1: FakeServer("prefill"),
                        D1: FakeServer("decode", chunks=[*_opening(), *tail])})


def _rid(fake: FakeCluster) -> str:
    """The turn's id, as the decode was sent it (the attempt's suffix cut)."""
    return fake.servers[D1].received[0]["rid"].split("-", 1)[0]


def _split(body: bytes) -> list[bytes]:
    return [e for e in body.split(b"\n\n") if e.strip()]


def test_a_stream_the_decode_cuts_ends_with_response_failed_and_is_kept_so():
    fake = _cluster([b"<error>"])

    async def go():
        async with served_client(fake, "--max-attempts", "1") as c:
            r = await c.post("/v1/responses", json=BODY)
            last = orjson.loads(_split(r.content)[-1].split(b"data: ", 1)[1])
            return r, last, await c.get(f"/v1/responses/{_rid(fake)}")

    r, last, got = run(go())
    events = _split(r.content)
    assert b"[DONE]" not in r.content and len(events) == 4
    assert events[-1].startswith(b"event: response.failed\ndata: ")
    assert last["type"] == "response.failed" and last["sequence_number"] == 3
    response = last["response"]
    assert response["id"] == _rid(fake)  # the turn's
    assert response["status"] == "failed" and response["model"] == "m"
    assert response["error"]["code"] == "server_error"
    assert "decode server" in response["error"]["message"]
    stored = got.json()
    assert stored["status"] == "failed" and stored["error"] == response["error"]


def test_a_stream_the_client_cuts_is_kept_cancelled_not_failed():
    async def go():
        fake = _cluster([b"<hang>"])
        app = make_app(fake, "--max-attempts", "1")
        async with app.router.lifespan_context(app):
            sent: list[dict] = []
            gone = asyncio.Event()
            body = orjson.dumps(BODY)
            asked = False

            async def receive() -> dict:
                nonlocal asked
                if not asked:
                    asked = True
                    return {"type": "http.request", "body": body, "more_body": False}
                await gone.wait()
                return {"type": "http.disconnect"}

            async def send(message: dict) -> None:
                sent.append(message)
                if message.get("body", b"").count(b"\n\n") and b"delta" in message["body"]:
                    gone.set()

            scope = {"type": "http", "method": "POST", "path": "/v1/responses",
                     "raw_path": b"/v1/responses", "query_string": b"", "root_path": "",
                     "headers": [(b"content-type", b"application/json"),
                                 (b"content-length", str(len(body)).encode()),
                                 (b"host", b"127.0.0.1")],
                     "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
                     "scheme": "http", "http_version": "1.1", "app": app}
            await asyncio.wait_for(app(scope, receive, send), 10)
            text = b"".join(m.get("body", b"") for m in sent)
            rid = _rid(fake)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://127.0.0.1") as client:
                return text, (await client.get(f"/v1/responses/{rid}")).json()

    text, stored = run(go())
    assert b"response.failed" not in text and b"delta" in text  # the client's view
    assert stored["status"] == "cancelled" and stored["error"] is None
    assert stored["incomplete_details"] == {"reason": "client_disconnected"}
