"""A /v1/messages body SGLang would refuse is refused by the gateway itself: 400
invalid_request_error in Anthropic's envelope, and neither leg sent (the simulated servers
receive nothing). Before, a malformed tool_result got a 500 and a traceback, and the other
shapes took a slot and both legs to come back as the server's 400."""

from __future__ import annotations

import httpx
import pytest

from tests.integration.conftest import sim_cluster

TEXT = {"type": "text", "text": "a"}
TOOLS = [{"name": "lookup", "input_schema": {"type": "object"}}]


def with_result(inner) -> dict:
    return {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": inner}]}]}


HI = {"messages": [{"role": "user", "content": "hi"}]}
BODIES = {
    "tool_result-string-item": with_result(["a"]),
    "tool_result-number-item": with_result([1]),
    "tool_result-null-item": with_result([None]),
    "tool_result-nested-list": with_result([[TEXT]]),
    "system-tool_result-string-item": {**HI, "system": [{"type": "tool_result",
                                                         "content": ["x"]}]},
    "unknown-block-type": {"messages": [{"role": "user", "content": [{"type": "frobnicate"}]}]},
    "stop_sequences-numbers": {**HI, "stop_sequences": [1, 2]},
    "tool_choice-undefined-tool": {**HI, "tools": TOOLS,
                                   "tool_choice": {"type": "tool", "name": "other"}},
    "tool_choice-any-without-tools": {**HI, "tool_choice": {"type": "any"}},
    "redacted_thinking-in-assistant-turn": {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}, TEXT]},
        {"role": "user", "content": "go on"}]},
    # SGLang's conversion makes a user chat message of tool calls without content, which its
    # ChatCompletionRequest refuses: the server's 400 came back after both legs were sent
    "user-turn-of-tool_use-alone": {"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {}}]}]},
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with sim_cluster(tmp_path_factory.mktemp("logs")) as c:
        yield c


def received(cluster) -> int:
    return sum(cluster.stats(url)["received"]
               for url in [p for p, _ in cluster.prefill] + cluster.decode)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("bad", list(BODIES.values()), ids=list(BODIES))
def test_refused_here_with_no_leg_sent(cluster, bad, stream):
    before = received(cluster)
    r = httpx.post(cluster.gateway + "/v1/messages", timeout=10,
                   json={"model": "sim-model", "max_tokens": 8, "stream": stream, **bad})
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["message"]
    assert received(cluster) == before


def test_count_tokens_refuses_a_malformed_tool_result_without_asking_a_server(cluster):
    before = received(cluster)
    r = httpx.post(cluster.gateway + "/v1/messages/count_tokens", timeout=10,
                   json={"model": "sim-model", **with_result(["a"])})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert received(cluster) == before
