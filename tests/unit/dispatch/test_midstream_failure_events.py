"""A failure a decode writes into a stream that has begun (SGLang's error event) is the
decode's failure: a resumable stream goes on on another
pair, any other ends with the gateway's own error event, and the server's words reach the
client without its peers' addresses (gateway/dispatch/stream_failure.py, relay.py)."""

from __future__ import annotations

import json

import orjson
import pytest

from tests.unit.fakes import FakeCluster, FakeServer, run, served_gateway

P1 = "http://127.0.0.1:30000"
D1, D2 = "http://127.0.0.1:30001", "http://127.0.0.1:30003"
DOWN = ("Prefill server with bootstrap_addr: 10.0.0.5:8998 is healthy before, but now it is "
        "down. Request (bootstrap_room: 7) has been marked as failed.")


def sse(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def native(text: str, ids: list[int], finish=None) -> bytes:
    return sse({"text": text, "output_ids": ids,
                "meta_info": {"id": "orig", "prompt_tokens": 3, "completion_tokens": len(ids),
                              "finish_reason": finish}})


def chat(content: str, finish=None) -> bytes:
    return sse({"id": "c", "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}]})


def openai_error(message: str, code: int) -> bytes:
    # as OpenAIServingBase.create_streaming_error_response writes it (json.dumps: spaces)
    return b"data: " + json.dumps({"error": {"object": "error", "message": message,
                                             "type": "INTERNAL_SERVER_ERROR", "param": None,
                                             "code": code}}).encode() + b"\n\n"


# as http_server.generate_request writes a late error into a native stream (orjson: no spaces)
NATIVE_ERROR = sse({"error": {"message": DOWN, "type": "invalid_request_error", "code": 500,
                              "retryable": False}})
DONE = b"data: [DONE]\n\n"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}


def events(body: bytes) -> list[bytes]:
    return [e for e in body.split(b"\n\n") if e.strip()]


def cluster(first: list[bytes], second: list[bytes] | None = None) -> FakeCluster:
    servers = {P1: FakeServer("prefill"), D1: FakeServer("decode", chunks=first)}
    if second is not None:
        servers[D2] = FakeServer("decode", chunks=second)
    return FakeCluster(servers)


async def _post(fake: FakeCluster, path: str, body: dict, *flags: str):
    async with served_gateway(fake, *flags) as (client, gw):
        r = await client.post(path, json=body)
        return r, gw.pool.get(D1).breaker.consecutive_failures


def test_a_native_error_after_tokens_continues_on_the_other_decode():
    fake = cluster([native(" a", [11]), NATIVE_ERROR, DONE],
                   [native(" c", [13]), native(" c d", [13, 14], {"type": "length"}), DONE])
    r, failures = run(_post(fake, "/generate", {"input_ids": [1, 2, 3], "stream": True,
                                                "sampling_params": {"max_new_tokens": 3}}))
    got = [orjson.loads(e[6:]) for e in events(r.content)[:-1]]
    assert [e["text"] for e in got] == [" a", " a c", " a c d"]  # the error event dropped
    assert fake.servers[D2].received[0]["input_ids"] == [1, 2, 3, 11]
    assert b"10.0.0.5" not in r.content and b"error" not in r.content
    assert failures == 1  # the decode's failure, as a cut stream's


@pytest.mark.parametrize("failure", [NATIVE_ERROR, openai_error(DOWN, 500)],
                         ids=["orjson", "json.dumps"])
def test_without_failover_the_stream_ends_with_the_gateways_error_and_no_address(failure):
    fake = cluster([native(" a", [11]), failure, DONE])
    r, failures = run(_post(fake, "/generate", {"input_ids": [1, 2], "stream": True},
                            "--no-midstream-failover"))
    sent = events(r.content)
    assert r.status_code == 200 and sent[-1] == b"data: [DONE]" and len(sent) == 3
    assert orjson.loads(sent[0][6:])["text"] == " a"
    error = orjson.loads(sent[1][6:])["error"]
    assert "is healthy before, but now it is down" in error["message"]
    assert "10.0.0.5" not in error["message"] and "127.0.0.1" not in error["message"]
    assert failures == 1


def test_a_chat_streams_error_event_after_tokens_is_cleaned_and_counted():
    fake = cluster([chat("Hel"), chat("lo"), openai_error(DOWN, 500), DONE])
    r, failures = run(_post(fake, "/v1/chat/completions", CHAT, "--no-midstream-failover"))
    sent = events(r.content)
    assert [orjson.loads(e[6:])["choices"][0]["delta"]["content"] for e in sent[:2]] == \
        ["Hel", "lo"]
    assert b"10.0.0.5" not in r.content and b'"error"' in sent[2]
    assert sent[-1] == b"data: [DONE]" and failures == 1


def test_a_refusal_mid_stream_is_not_the_decodes_failure_and_is_not_retried():
    refusal = openai_error("the tool call at 10.0.0.9:1 could not be parsed", 400)
    fake = cluster([chat("Hel"), refusal, DONE], [chat("never"), DONE])
    r, failures = run(_post(fake, "/v1/chat/completions", CHAT))
    sent = events(r.content)
    error = orjson.loads(sent[1][6:])["error"]
    assert "could not be parsed" in error["message"] and "10.0.0.9" not in error["message"]
    assert sent[-1] == b"data: [DONE]" and not fake.servers[D2].received
    assert failures == 0


def test_the_words_error_and_abort_in_generated_text_pass_through_untouched():
    quoted = [chat('he said "error"'), native('"abort" now', [5]),
              chat("done", "stop"), DONE]
    graceful = native(" x", [6], {"type": "abort", "message": "aborted by the client"})
    for stream in (quoted, [native(" a", [5]), graceful, DONE]):
        fake = cluster(stream)
        r, failures = run(_post(fake, "/generate", {"input_ids": [1], "stream": True}))
        assert r.content == b"".join(stream) and failures == 0


def test_a_messages_stream_error_event_after_text_ends_as_anthropics_error():
    opening = (b'event: message_start\ndata: {"type":"message_start","message":{"id":"m",'
               b'"type":"message","role":"assistant","content":[],"model":"m",'
               b'"usage":{"input_tokens":3,"output_tokens":0}}}\n\n')
    block = (b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
             b'"content_block":{"type":"text","text":""}}\n\n')
    delta = (b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
             b'"delta":{"type":"text_delta","text":"Hi"}}\n\n')
    failure = (b'event: error\ndata: ' + orjson.dumps(
        {"type": "error", "error": {"type": "api_error", "message": DOWN}}) + b"\n\n")
    stop = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    fake = cluster([opening, block, delta, failure, stop])
    r, failures = run(_post(fake, "/v1/messages", {
        "model": "m", "max_tokens": 8, "stream": True,
        "messages": [{"role": "user", "content": "hi"}]}, "--no-midstream-failover"))
    sent = events(r.content)
    assert sent[-1].startswith(b"event: error") and b"10.0.0.5" not in r.content
    assert b"is healthy before" in sent[-1] and b'"text":"Hi"' in r.content
    assert failures == 1

