"""A stream in another legal SSE framing than SGLang's (a proxy's: "\r\n" or "\r" line ends,
data in several lines) is relayed as the server sent it, event by event, and ends well: the
relay finds its events' ends and its last event as gateway/sse.py reads them."""

from __future__ import annotations

import orjson
import pytest

from tests.unit.fakes import FakeCluster, FakeServer, run, served_client

P1, D1 = "http://127.0.0.1:30000", "http://127.0.0.1:30001"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}


def _chat(end: bytes) -> bytes:
    delta = orjson.dumps({"id": "s", "choices": [{"index": 0, "delta": {"content": "a"}}]})
    return (b"data: " + delta + end + end) * 2 + b"data: [DONE]" + end + end


def _responses(end: bytes) -> bytes:
    def event(kind: str, status: str) -> bytes:
        data = orjson.dumps({"type": kind, "response": {"id": "r", "object": "response",
                                                        "status": status, "output": []}},
                            option=orjson.OPT_INDENT_2)
        lines = [b"event: " + kind.encode(), *(b"data: " + line for line in data.split(b"\n"))]
        return end.join(lines) + end + end
    return event("response.created", "in_progress") + event("response.completed", "completed")


def _cuts(stream: bytes, end: bytes) -> list[bytes]:
    """The stream in reads cut inside its first event and inside the blank line after it
    (between the "\r" and "\n" of a "\r\n")."""
    blank = stream.index(end + end) + 2 * len(end) - 1
    return [stream[:7], b"<pause>", stream[7:blank], b"<pause>", stream[blank:]]


@pytest.mark.parametrize("end", [pytest.param(b"\r\n", id="crlf"), pytest.param(b"\r", id="cr")])
@pytest.mark.parametrize("path, body, stream", [
    pytest.param("/v1/chat/completions", CHAT, _chat, id="chat"),
    pytest.param("/v1/responses", {"model": "m", "input": "hi", "stream": True}, _responses,
                 id="responses"),
])
def test_a_stream_in_another_framing_is_relayed_as_it_came(end, path, body, stream):
    sent = stream(end)
    fakes = FakeCluster({P1: FakeServer("prefill"),
                         D1: FakeServer("decode", chunks=_cuts(sent, end))})

    async def go():
        async with served_client(fakes, "--no-midstream-failover", "--max-attempts", "1") as c:
            return await c.post(path, json=body)

    r = run(go())
    assert r.status_code == 200
    assert r.content == sent
