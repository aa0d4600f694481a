"""The Anthropic SDK against /v1/messages through the gateway, in front of real SGLang 0.5.23
PD servers on CPU; every answer is checked against the plain (non-PD) server's own
/v1/messages answer to the same request (greedy, so equal text means the same prompt)."""

from __future__ import annotations

import anthropic
import pytest

from tests.e2e_sglang.conftest import SglangCluster
from tests.messages_tools import TOOL_HISTORY, TOOLS

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]  # the first test pays the start-up

SYSTEM = "You are terse."
HISTORY = [{"role": "user", "content": "tell me about the quick brown fox"},
           {"role": "assistant", "content": "the fox jumps over the lazy dog"},
           {"role": "user", "content": [{"type": "text", "text": "and then?"}]}]


def clients(cluster: SglangCluster) -> tuple[anthropic.Anthropic, anthropic.Anthropic]:
    """Through the gateway, and straight to the plain server."""
    def make(url: str) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=180)
    return make(cluster.gateway), make(cluster.null_url)


def test_plain_and_streamed_messages_equal_the_plain_server(
        sglang_cluster: SglangCluster) -> None:
    gw, plain = clients(sglang_cluster)
    kwargs = {"model": sglang_cluster.model_name, "max_tokens": 12, "extra_body": {"temperature": 0},
              "system": SYSTEM, "messages": HISTORY}
    got = gw.messages.create(**kwargs)
    want = plain.messages.create(**kwargs)
    assert got.content[0].type == "text"
    assert got.content[0].text == want.content[0].text
    assert got.usage.output_tokens == want.usage.output_tokens > 0
    assert got.stop_reason == want.stop_reason
    with gw.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == want.content[0].text
    assert final.usage.output_tokens == want.usage.output_tokens
    kinds = [event.type for event in gw.messages.create(stream=True, **kwargs)]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_delta" in kinds and "message_delta" in kinds


def test_tools_shaped_request_and_count_tokens(sglang_cluster: SglangCluster) -> None:
    gw, plain = clients(sglang_cluster)
    kwargs = {"model": sglang_cluster.model_name, "max_tokens": 8, "extra_body": {"temperature": 0},
              "tools": TOOLS, "messages": TOOL_HISTORY}
    got = gw.messages.create(**kwargs)
    want = plain.messages.create(**kwargs)
    assert [b.type for b in got.content] == [b.type for b in want.content]
    assert got.content[0].text == want.content[0].text
    counted = gw.messages.count_tokens(model=sglang_cluster.model_name, tools=TOOLS,
                                       messages=TOOL_HISTORY)
    reference = plain.messages.count_tokens(model=sglang_cluster.model_name, tools=TOOLS,
                                            messages=TOOL_HISTORY)
    assert counted.input_tokens == reference.input_tokens > 0


def test_gateway_made_error_parses_as_anthropic(sglang_cluster: SglangCluster) -> None:
    gw, _ = clients(sglang_cluster)
    with pytest.raises(anthropic.BadRequestError) as caught:
        gw.messages.create(model=sglang_cluster.model_name, max_tokens=0,
                           messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["error"]["type"] == "invalid_request_error"
