"""Streamed chunks written straight to the transport (uvicorn_send.UvicornSend.chunk), at the
socket level: a stream is valid chunked HTTP that a client's parser reads to the end, and the
connection stays usable for the next request (a framing byte off would garble it); on a
stand-in cycle, that each chunk is one write of exactly uvicorn's framing and that it declines
whenever `send` would have to wait (backpressure: the slow-reader attack in
test_slow_reader.py runs through it) or do something else."""

from __future__ import annotations

import orjson

from gateway.routes.uvicorn_send import UvicornSend
from tests.security.honest import connect
from tests.security.test_whole_answers import Answers, Cycle, check, request

STREAM = orjson.dumps({"text": "stream to me", "stream": True,
                       "sampling_params": {"max_new_tokens": 24}})


def stream_request(rid: bytes) -> bytes:
    return (b"POST /generate HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
            b"x-request-id: " + rid + b"\r\ncontent-length: %d\r\n\r\n" % len(STREAM) + STREAM)


def events(body: bytes) -> list[bytes]:
    return [line[len(b"data:"):].strip() for line in body.split(b"\n")
            if line.startswith(b"data:")]


def test_streams_and_answers_share_one_kept_alive_connection(fast):
    with connect(fast.port) as sock:
        answers = Answers()
        sock.sendall(stream_request(b"stream-1"))
        (streamed,) = answers.read(sock, 1)
        assert streamed["status"] == 200 and streamed["keep_alive"]
        assert streamed["headers"][b"transfer-encoding"] == b"chunked"
        data = events(streamed["body"])
        assert data[-1] == b"[DONE]" and data.count(b"[DONE]") == 1
        texts = [orjson.loads(d)["text"] for d in data[:-1]]
        assert len(texts) >= 2 and texts[-1], texts
        sock.sendall(request(b"after-stream") + stream_request(b"stream-2"))  # pipelined too
        got = answers.read(sock, 3)
        check(got[1], b"after-stream")
        assert events(got[2]["body"])[-1] == b"[DONE]"


class ChunkedCycle(Cycle):
    def __init__(self) -> None:
        super().__init__()
        self.response_started = True
        self.chunked_encoding = True


def test_each_chunk_is_one_write_framed_as_uvicorn_frames_it():
    cycle = ChunkedCycle()
    chunks = UvicornSend(cycle).chunk
    assert chunks(b"data: {}\n\n") and chunks(b"x" * 300)
    assert cycle.transport.writes == [b"a\r\ndata: {}\n\n\r\n", b"12c\r\n" + b"x" * 300 + b"\r\n"]
    assert not cycle.response_complete and cycle.completed == 0  # the end goes through send


def test_it_declines_where_send_must_wait_or_do_more():
    for spoil in ("not started", "complete", "disconnected", "paused", "not chunked", "empty",
                  "gone"):
        cycle = ChunkedCycle()
        body = b"data: {}\n\n"
        if spoil == "not started":
            cycle.response_started = False
        elif spoil == "complete":
            cycle.response_complete = True
        elif spoil == "disconnected":
            cycle.disconnected = True
        elif spoil == "paused":
            cycle.flow.write_paused = True
        elif spoil == "not chunked":
            cycle.chunked_encoding = False
        elif spoil == "empty":
            body = b""
        chunks = UvicornSend(cycle).chunk
        if spoil == "gone":  # held weakly: a finished request's cycle is let go
            del cycle
            assert not chunks(body)
            continue
        assert not chunks(body), spoil
        assert cycle.transport.writes == [], spoil
