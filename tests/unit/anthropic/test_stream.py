"""/v1/messages streams through the dispatcher: where a stream ends, which failures are retried,
and how a failure after the stream began reaches the client (no sockets)."""

import orjson
import pytest

from gateway.anthropic.errors import error_type
from gateway.anthropic.stream import leading_failure
from tests.unit.fakes import FakeCluster, FakeServer, run
from tests.unit.fakes import served as gateway

P1 = "http://127.0.0.1:30000"
D1, D2 = "http://127.0.0.1:30001", "http://127.0.0.1:30003"
BODY = {"model": "m", "max_tokens": 4, "stream": True,
        "messages": [{"role": "user", "content": "hi"}]}


def event(payload: dict) -> bytes:
    return b"event: " + payload["type"].encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


START = event({"type": "message_start", "message": {"id": "msg_1", "type": "message",
                                                     "role": "assistant", "content": [],
                                                     "model": "m", "usage": {}}})
BLOCK = event({"type": "content_block_start", "index": 0,
               "content_block": {"type": "text", "text": ""}})
DELTA = event({"type": "content_block_delta", "index": 0,
               "delta": {"type": "text_delta", "text": "ok"}})
END = [event({"type": "content_block_stop", "index": 0}),
       event({"type": "message_delta", "delta": {"stop_reason": "end_turn"},
              "usage": {"output_tokens": 1}}),
       event({"type": "message_stop"})]
GOOD = [START, BLOCK, DELTA, *END]
OVERLOADED = event({"type": "error", "error": {"type": "overloaded_error",
                                               "message": "KV transfer failed"}})


def post_twice(cluster: FakeCluster) -> list[tuple[int, bytes]]:
    async def go():
        async with gateway(cluster) as (client, _):
            out = []
            for _ in range(2):  # ties rotate: one of them meets D1 first
                r = await client.post("/v1/messages", json=BODY)
                out.append((r.status_code, r.content))
            return out

    return run(go())


def test_error_after_message_start_is_retried_on_another_decode():
    cluster = FakeCluster({P1: FakeServer("prefill"),
                           D1: FakeServer("decode", chunks=[START, OVERLOADED,
                                                            event({"type": "message_stop"})]),
                           D2: FakeServer("decode", chunks=GOOD)})
    answers = post_twice(cluster)
    assert cluster.servers[D1].received, "the failing decode was never tried"
    assert answers == [(200, b"".join(GOOD))] * 2


def test_error_after_content_ends_the_stream_as_the_decodes_failure():
    """After content the client has seen, the failure is the decode's (gateway/dispatch/
    stream_failure.py): the events before it, then the gateway's error event, with the
    server's words (a Messages stream is not continued elsewhere)."""
    cut = [START, BLOCK, DELTA, OVERLOADED, event({"type": "message_stop"})]
    cluster = FakeCluster({P1: FakeServer("prefill"), D1: FakeServer("decode", chunks=cut)})

    async def go():
        async with gateway(cluster) as (client, app):
            r = await client.post("/v1/messages", json=BODY)
            return (r.status_code, r.content,
                    app.state.gateway.pool.get(D1).breaker.consecutive_failures)

    status, body, failures = run(go())
    assert status == 200 and body.startswith(START + BLOCK + DELTA)
    ending = body[len(START + BLOCK + DELTA):]
    assert ending.startswith(b"event: error\n") and ending.count(b"\n\n") == 1
    error = orjson.loads(ending.split(b"data: ", 1)[1])["error"]
    assert error["type"] == "api_error" and "KV transfer failed" in error["message"]
    assert len(cluster.servers[D1].received) == 1 and failures == 1


def test_stream_without_message_stop_ends_with_an_anthropic_error_event():
    cluster = FakeCluster({P1: FakeServer("prefill"),
                           D1: FakeServer("decode", chunks=[START, BLOCK, DELTA])})

    async def go():
        async with gateway(cluster) as (client, _):
            r = await client.post("/v1/messages", json=BODY)
            return r.content

    body = run(go())
    assert body.startswith(START + BLOCK + DELTA)
    tail = body[len(START + BLOCK + DELTA):]
    assert tail.startswith(b"event: error\ndata: ") and b"data: [DONE]" not in tail
    error = orjson.loads(tail.split(b"data: ", 1)[1])
    assert error["type"] == "error" and error["error"]["type"] == "api_error"


@pytest.mark.parametrize(("head", "want"), [
    (START + OVERLOADED, (503, "KV transfer failed")),
    (START + BLOCK + OVERLOADED, (503, "KV transfer failed")),
    (START + DELTA + OVERLOADED, None),
    (START, None),
    (START + b"event: error\ndata: {not json\n\n", (502, "the decode server's error event "
                                                         "is not JSON")),
], ids=["after-start", "after-block-start", "after-content", "no-error", "garbled"])
def test_leading_failure(head, want):
    assert leading_failure(head) == want


@pytest.mark.parametrize(("status", "kind"), [
    (400, "invalid_request_error"), (401, "authentication_error"), (404, "not_found_error"),
    (413, "request_too_large"), (429, "rate_limit_error"), (503, "overloaded_error"),
    (502, "api_error"), (504, "api_error"), (408, "invalid_request_error"), (500, "api_error"),
])
def test_error_types_follow_sglang(status, kind):
    assert error_type(status) == kind
