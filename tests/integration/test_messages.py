"""The Anthropic SDK against /v1/messages through the gateway and simulated PD servers.

The gateway asks for a key here: the SDK sends it as `x-api-key`, which the gateway accepts.
Every answer is compared with a plain (null) server's answer to the same body: the sim's
text is a function of the prompt it rendered, so equal text means the PD legs got the
conversation as sent.
"""

from __future__ import annotations

import anthropic
import httpx
import pytest

from tests.integration.conftest import sim_cluster
from tests.messages_tools import TOOL_HISTORY, TOOLS

KEY = "messages-test-key"
SYSTEM = "You answer in riddles."
HISTORY = [{"role": "user", "content": "hello there"},
           {"role": "assistant", "content": "and hello to you"},
           {"role": "user", "content": [{"type": "text", "text": "tell me more"}]}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with sim_cluster(tmp_path_factory.mktemp("logs"), null=True,
                     gateway_args=["--api-keys", KEY, "--stream-idle-timeout", "2"]) as c:
        yield c


@pytest.fixture
def fresh(cluster):
    cluster.reset()
    yield cluster
    cluster.reset()


def client(cluster, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=cluster.gateway, api_key=key, max_retries=0, timeout=30)


def direct(cluster, path: str, body: dict) -> dict:
    return httpx.post(cluster.null + path, json={"model": "sim-model", **body}, timeout=30).json()


def faults(url: str, **knobs) -> None:
    httpx.post(url + "/sim/faults", json=knobs, timeout=5).raise_for_status()


def test_plain_message_is_the_servers_answer(fresh):
    got = client(fresh).messages.create(model="sim-model", max_tokens=8, system=SYSTEM,
                                        messages=HISTORY)
    want = direct(fresh, "/v1/messages", {"max_tokens": 8, "system": SYSTEM,
                                          "messages": HISTORY})
    assert got.type == "message" and got.role == "assistant"
    assert got.content[0].type == "text" and got.content[0].text
    assert got.content[0].text == want["content"][0]["text"]
    assert got.stop_reason == "max_tokens"
    assert got.usage.output_tokens == 8
    prompt = want["usage"]["input_tokens"] + want["usage"].get("cache_read_input_tokens", 0)
    assert got.usage.input_tokens + (got.usage.cache_read_input_tokens or 0) == prompt


def test_stream_helper_relays_the_text_and_usage(fresh):
    with client(fresh).messages.stream(model="sim-model", max_tokens=10, system=SYSTEM,
                                       messages=HISTORY) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    want = direct(fresh, "/v1/messages", {"max_tokens": 10, "system": SYSTEM,
                                          "messages": HISTORY})
    assert len(pieces) > 1
    assert "".join(pieces) == want["content"][0]["text"]
    assert final.usage.output_tokens == 10 and final.stop_reason == "max_tokens"


def test_raw_stream_has_anthropics_event_order(fresh):
    events = list(client(fresh).messages.create(model="sim-model", max_tokens=5, stream=True,
                                                messages=[{"role": "user", "content": "go"}]))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds[1] == "content_block_start" and "content_block_delta" in kinds
    assert kinds[-3:-1] == ["content_block_stop", "message_delta"]
    assert events[-2].usage.output_tokens == 5


def test_tools_shaped_request_and_its_count(fresh):
    body = {"max_tokens": 6, "tools": TOOLS, "messages": TOOL_HISTORY}
    got = client(fresh).messages.create(model="sim-model", **body)
    want = direct(fresh, "/v1/messages", body)
    assert got.content[0].text == want["content"][0]["text"]
    counted = client(fresh).messages.count_tokens(model="sim-model", tools=TOOLS,
                                                  messages=TOOL_HISTORY)
    plain = client(fresh).messages.count_tokens(model="sim-model", messages=TOOL_HISTORY[:1])
    assert counted.input_tokens == direct(fresh, "/v1/messages/count_tokens",
                                          {"tools": TOOLS, "messages": TOOL_HISTORY})[
        "input_tokens"]
    assert counted.input_tokens > plain.input_tokens > 0


def test_usage_is_counted_per_tenant(fresh):
    before = httpx.get(fresh.gateway + "/admin/usage", timeout=5).json()["total"]
    with client(fresh).messages.stream(model="sim-model", max_tokens=7,
                                       messages=HISTORY) as stream:
        stream.get_final_message()
    client(fresh).messages.create(model="sim-model", max_tokens=3, messages=HISTORY)
    after = httpx.get(fresh.gateway + "/admin/usage", timeout=5).json()["total"]
    assert after["completion_tokens"] - before["completion_tokens"] == 10
    assert after["prompt_tokens"] > before["prompt_tokens"]


def test_wrong_key_is_an_authentication_error(fresh):
    with pytest.raises(anthropic.AuthenticationError) as caught:
        client(fresh, key="not-the-key").messages.create(
            model="sim-model", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        client(fresh, key="not-the-key").messages.count_tokens(
            model="sim-model", messages=[{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("bad", [{"max_tokens": 0}, {"max_tokens": 4, "messages": []},
                                 {"max_tokens": 4, "bootstrap_room": 7}],
                         ids=["max_tokens-zero", "no-messages", "gateway-owned-field"])
def test_invalid_request_is_a_bad_request_error(fresh, bad):
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], **bad}
    with pytest.raises(anthropic.BadRequestError) as caught:
        client(fresh).post("/v1/messages", body=body, cast_to=object)
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert caught.value.body["error"]["message"]


def test_decode_failing_before_the_first_event_is_retried(fresh):
    broken = fresh.decode[0]
    faults(broken, error_rate=1.0)
    c = client(fresh)
    # until the least-load decode policy has sent one to the broken decode (a /v1/loads
    # snapshot taken while an earlier test's request ran there can keep it looking busier
    # for up to a poll: CI once sent 6 of 6 to the healthy one); every stream completes
    for i in range(30):
        with c.messages.stream(model="sim-model", max_tokens=4,
                               messages=[{"role": "user", "content": f"try {i}"}]) as stream:
            assert stream.get_final_message().usage.output_tokens == 4
        if fresh.stats(broken)["faults_applied"].get("error_rate", 0) > 0 and i >= 5:
            break
    assert fresh.stats(broken)["faults_applied"].get("error_rate", 0) > 0


def test_decode_stalling_mid_stream_ends_with_an_error_event(fresh):
    for url in fresh.decode:
        faults(url, stall_after=4)  # start, block start, a token or two, then silence
    pieces = []
    with pytest.raises(anthropic.APIStatusError) as caught:
        with client(fresh).messages.stream(model="sim-model", max_tokens=30,
                                           messages=HISTORY) as stream:
            pieces.extend(stream.text_stream)
    assert pieces  # the stream had begun: it cannot be retried from scratch
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "api_error"


@pytest.mark.parametrize(("method", "path", "status", "kind"), [
    ("GET", "/v1/messages", 405, "invalid_request_error"),
    ("POST", "/v1/messages/batches", 404, "not_found_error"),
], ids=["wrong-method", "unknown-path"])
def test_route_errors_under_messages_are_anthropic(fresh, method, path, status, kind):
    r = httpx.request(method, fresh.gateway + path, headers={"x-api-key": KEY}, timeout=10)
    assert r.status_code == status
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind


def test_the_sdk_sees_the_request_id_of_answers_streams_and_errors(fresh):
    """Anthropic's SDK reads `request-id` (its `_request_id`, `APIStatusError.request_id`); the
    gateway sent only `x-request-id`, so every id there was None (2026-12-07)."""
    asked = {"model": "sim-model", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    raw = client(fresh).messages.with_raw_response.create(**asked)
    assert raw.request_id and raw.request_id == raw.headers["x-request-id"]
    assert raw.parse()._request_id == raw.request_id
    streamed = client(fresh).messages.with_raw_response.create(**asked, stream=True)
    assert streamed.request_id and streamed.request_id == streamed.headers["x-request-id"]
    assert [event.type for event in streamed.parse()][-1] == "message_stop"
    with pytest.raises(anthropic.AuthenticationError) as caught:
        client(fresh, key="not-the-key").messages.create(**asked)
    assert caught.value.request_id and caught.value.request_id == caught.value.body["request_id"]
    counted = client(fresh).messages.with_raw_response.count_tokens(
        model="sim-model", messages=asked["messages"])
    assert counted.request_id == counted.headers["x-request-id"]
