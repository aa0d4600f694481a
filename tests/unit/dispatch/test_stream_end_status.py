"""How a begun stream's end is counted and judged.

* A stream that ends with an error event (the decode failed mid-stream, and no continuation)
  counts as failed, with the error's status, in `gateway_requests_total`, as a stream the
  gateway cut does: until 2026-12-07 it counted 200 (its head's), so every dashboard and the
  tenants' `errors_5xx` missed it.
* A comment (": ping", a proxy's keep-alive) after a stream's final event is no event: the
  stream is complete. Until 2026-12-07 the relay read the comment as the last event and ended
  a complete stream with an error event ("ended the stream without [DONE]").
"""

from __future__ import annotations

import pytest

from gateway.sse import ends_finished
from tests.unit.dispatch.test_midstream_failure_events import (
    CHAT,
    DONE,
    DOWN,
    _post,
    chat,
    cluster,
    events,
    openai_error,
)
from tests.unit.fakes import run, served_gateway
from tests.unit.observability.test_request_metrics import sample

PING = b": ping\n\n"
STOP = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
MESSAGES = {"model": "m", "max_tokens": 8, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}


def _statuses(page: str, endpoint: str) -> dict[str, float]:
    found = {}
    for status in ("200", "500", "502", "503"):
        try:
            found[status] = sample(page, "gateway_requests_total", endpoint=endpoint,
                                   status=status)
        except AssertionError:
            pass
    return found


def test_a_stream_ended_by_the_decodes_error_counts_as_failed_not_200():
    fake = cluster([chat("Hel"), openai_error(DOWN, 500), DONE])

    async def go():
        async with served_gateway(fake, "--no-midstream-failover") as (client, gw):
            r = await client.post("/v1/chat/completions", json=CHAT)
            gw.metrics.flush()
            return r, (await client.get("/metrics")).text

    r, page = run(go())
    assert r.status_code == 200 and b'"error"' in events(r.content)[1]  # the client's view
    counted = _statuses(page, "chat")
    assert "200" not in counted and sum(counted.values()) == 1, counted


def test_a_whole_stream_still_counts_200():
    fake = cluster([chat("Hel"), chat("lo", "stop"), DONE])

    async def go():
        async with served_gateway(fake) as (client, gw):
            r = await client.post("/v1/chat/completions", json=CHAT)
            gw.metrics.flush()
            return r, (await client.get("/metrics")).text

    r, page = run(go())
    assert r.status_code == 200 and _statuses(page, "chat") == {"200": 1.0}


@pytest.mark.parametrize(("path", "body", "chunks"), [
    ("/v1/chat/completions", CHAT, [chat("Hi", "stop"), DONE, PING]),
    ("/v1/chat/completions", CHAT, [chat("Hi", "stop"), DONE + PING]),
    ("/v1/messages", MESSAGES, [STOP, PING]),
    ("/v1/messages", MESSAGES, [STOP + PING + PING]),
], ids=["chat-own-read", "chat-same-read", "messages-own-read", "messages-same-read"])
def test_a_comment_after_the_final_event_leaves_the_stream_complete(path, body, chunks):
    fake = cluster(chunks)
    r, failures = run(_post(fake, path, body, "--no-midstream-failover"))
    assert r.status_code == 200 and b"error" not in r.content, r.content
    assert failures == 0


@pytest.mark.parametrize(("last", "prior", "finished"), [
    (PING, DONE, True),
    (DONE + PING, b"", True),
    (STOP + PING, b"", True),
    (PING, STOP, True),
    (PING, chat("Hi"), False),  # a comment after an unfinished stream is still unfinished
    (PING, b"", False),
    (chat("Hi") + PING, b"", False),
])
def test_ends_finished_skips_comments(last, prior, finished):
    assert ends_finished(last, prior) is finished
