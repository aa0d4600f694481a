"""/v1/responses through the gateway in front of real SGLang 0.5.23 PD servers on CPU: plain
and streamed answers equal to a plain server's, and a previous_response_id chain of 5 turns
kept by the gateway, spread over both decodes, each turn finding the previous prompt in the
prefill's cache (SGLang itself keeps no response state in PD mode)."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import openai
import pytest

from tests.e2e_sglang.conftest import SglangCluster
from tests.procs import HOST, free_port, python, running

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]  # the first test pays the start-up

GREEDY = {"temperature": 0, "max_output_tokens": 8}


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)


@contextlib.contextmanager
def round_robin_gateway(cluster: SglangCluster):
    """A second gateway on the same servers whose decode policy alternates: a chain of turns
    is then spread over both decodes by construction."""
    port = free_port()
    argv = python("-m", "gateway", "--host", HOST, "--port", str(port),
                  "--prefill-policy", "cache_aware", "--decode-policy", "round_robin")
    for server in cluster.prefill:
        argv += ["--prefill", server.url, str(server.bootstrap_port)]
    for server in cluster.decode:
        argv += ["--decode", server.url]
    url = f"http://{HOST}:{port}"
    with running("gateway-responses", argv, cluster.log_dir, url + "/readiness", timeout=120):
        yield url


def test_plain_and_streamed_equal_a_plain_server(sglang_cluster: SglangCluster) -> None:
    gw, plain = client(sglang_cluster.gateway), client(sglang_cluster.null_url)
    model = sglang_cluster.model_name
    got = gw.responses.create(model=model, input="Say something.", **GREEDY)
    want = plain.responses.create(model=model, input="Say something.", store=False, **GREEDY)
    assert got.id.startswith("resp_") and got.status in ("completed", "incomplete")
    assert got.output_text == want.output_text
    assert got.usage.input_tokens == want.usage.input_tokens
    with gw.responses.stream(model=model, input="Say something.", **GREEDY) as stream:
        kinds = [event.type for event in stream]
    deltas = [k for k in kinds if k == "response.output_text.delta"]
    assert kinds[0] == "response.created" and deltas
    assert kinds[-1] in ("response.completed", "response.incomplete")
    kept = gw.responses.retrieve(got.id)
    assert kept.output_text == got.output_text


def test_chain_of_five_turns_over_both_decodes(sglang_cluster: SglangCluster) -> None:
    model = sglang_cluster.model_name
    with round_robin_gateway(sglang_cluster) as url:
        gw = client(url)
        previous, turns = None, []
        for i in range(5):
            r = gw.responses.create(model=model, input=f"Question {i}: and then what?",
                                    previous_response_id=previous, **GREEDY)
            assert r.status in ("completed", "incomplete"), r
            turns.append(r)
            previous = r.id
        metrics = httpx.get(url + "/metrics", timeout=30).text
        items = httpx.get(f"{url}/v1/responses/{turns[-1].id}/input_items?order=asc",
                          timeout=30).json()["data"]
    decodes = {s.url for s in sglang_cluster.decode}
    picks = {line.split('server="', 1)[1].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
             for line in metrics.splitlines()
             if line.startswith("gateway_routing_decisions_total") and 'role="decode"' in line}
    assert set(picks) == decodes and min(picks.values()) >= 2, picks
    inputs = [t.usage.input_tokens for t in turns]
    cached = [t.usage.input_tokens_details.cached_tokens for t in turns]
    print(f"input tokens {inputs}; cached tokens {cached}")
    assert inputs == sorted(inputs) and inputs[-1] > inputs[0], inputs
    for turn in range(1, 5):  # the previous turn's prompt is the prefix of this one's
        assert cached[turn] >= 0.9 * inputs[turn - 1], (inputs, cached)
    # the conversation the last turn answered: every question and every answer, in order
    assert [i["role"] for i in items] == ["user", "assistant"] * 4 + ["user"]
    for k in range(4):
        assert items[2 * k + 1]["content"][0]["text"] == turns[k].output_text


def _first_stop(text: str, stops: list[str]) -> int | None:
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def _stops(texts: list[str]) -> list[str]:
    """Two-character stop strings such that each greedy answer in `texts` ends at one after
    at least one character: a random tiny model never emits EOS, and the Agents SDK takes an
    answer cut by max_output_tokens (`incomplete`) as a model error."""
    stops: list[str] = []
    for text in texts:
        if _first_stop(text, stops) is not None:
            continue
        for i in range(1, len(text) - 1):
            if text.find(text[i:i + 2]) == i:
                stops.append(text[i:i + 2])
                break
    return stops


def test_openai_agents_sdk_converses_through_the_gateway(sglang_cluster: SglangCluster) -> None:
    """An agent framework that speaks only Responses (the OpenAI Agents SDK) runs two turns,
    the second continuing the first by `previous_response_id`, which the gateway expands."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    gw, model_name = client(sglang_cluster.gateway), sglang_cluster.model_name
    ask = {"model": model_name, "instructions": "Answer briefly.", "temperature": 0,
           "max_output_tokens": 24}
    first_probe = gw.responses.create(input="Hello there", **ask)
    second_probe = gw.responses.create(input="And then?", store=False,
                                       previous_response_id=first_probe.id, **ask)
    stops = _stops([first_probe.output_text, second_probe.output_text])
    for text in (first_probe.output_text, second_probe.output_text):
        assert (_first_stop(text, stops) or 0) >= 1, (text, stops)

    async def converse() -> tuple:
        model = agents.OpenAIResponsesModel(
            model=model_name,
            openai_client=openai.AsyncOpenAI(base_url=sglang_cluster.gateway + "/v1",
                                             api_key="x", max_retries=0, timeout=120))
        settings = agents.ModelSettings(max_tokens=24, temperature=0,
                                        extra_body={"stop": stops})
        agent = agents.Agent(name="helper", instructions="Answer briefly.", model=model,
                             model_settings=settings)
        first = await agents.Runner.run(agent, "Hello there")
        second = await agents.Runner.run(agent, "And then?",
                                         previous_response_id=first.last_response_id)
        return first, second

    first, second = asyncio.run(converse())
    assert isinstance(first.final_output, str) and first.final_output
    assert isinstance(second.final_output, str) and second.final_output
    assert second.last_response_id != first.last_response_id
    items = httpx.get(f"{sglang_cluster.gateway}/v1/responses/{second.last_response_id}"
                      "/input_items", timeout=30).json()["data"]
    assert len(items) == 3, items  # Hello there, the first answer, And then?
