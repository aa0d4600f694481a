"""/v1/responses through the gateway with the real OpenAI SDK, against simulated PD servers:
plain and streamed answers, a previous_response_id chain kept by the gateway across both
decodes (the prefill's prefix hits kept), retrieve/delete/cancel, tenants, `background`,
and an agent framework (the OpenAI Agents SDK) end to end."""

from __future__ import annotations

import asyncio
import threading

import httpx
import openai
import pytest

from tests.integration.conftest import sim_cluster

KEYS = {"tenant-a": "key-a", "tenant-b": "key-b"}
TOKEN_DELAY = "0.01"  # seconds per decode step: a 16-token answer takes ~0.2 s


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    key_file = logs / "keys"
    key_file.write_text("".join(f"{key} {tenant}\n" for tenant, key in KEYS.items()))
    with sim_cluster(logs, sim_args=["--token-delay", TOKEN_DELAY, "--enable-cache-report"],
                     gateway_args=["--api-key-file", str(key_file),
                                   "--prefill-policy", "cache_aware",
                                   "--decode-policy", "round_robin"]) as c:
        yield c


def client(cluster, tenant: str = "tenant-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.gateway + "/v1", api_key=KEYS[tenant], max_retries=0)


def served(cluster) -> dict[str, int]:
    return {url: cluster.stats(url)["requests"].get("/v1/responses", 0)
            for url in cluster.decode}


def prefill_cached(cluster) -> int:
    return sum(r["cached_tokens"] for r in cluster.stats(cluster.prefill[0][0])["dp_ranks"])


def test_plain_answer_is_a_response_with_the_gateway_id(cluster):
    r = client(cluster).responses.create(model="m", input="Say hello.", max_output_tokens=8)
    assert r.id.startswith("resp_") and r.object == "response"
    assert r.status in ("completed", "incomplete") and r.output_text
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    got = client(cluster).responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text


def test_stream_relays_the_typed_events_and_keeps_the_final_response(cluster):
    with client(cluster).responses.stream(model="m", input="Stream a little.") as stream:
        kinds = [event.type for event in stream]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert "response.output_text.delta" in kinds
    assert kinds[-1] in ("response.completed", "response.incomplete")
    body = httpx.post(cluster.gateway + "/v1/responses", headers=_auth("tenant-a"),
                      json={"model": "m", "input": "raw stream", "stream": True}, timeout=30)
    text = body.text
    assert text.rstrip().rsplit("\n\n", 1)[-1].startswith("event: response.incomplete")
    assert "data: [DONE]" not in text  # a Responses stream ends with its final event
    rid = text.split('"id":"', 1)[1].split('"', 1)[0]
    stored = client(cluster).responses.retrieve(rid)
    assert stored.status in ("completed", "incomplete") and stored.output_text


def _auth(tenant: str) -> dict:
    return {"authorization": f"Bearer {KEYS[tenant]}"}


def test_chain_of_five_turns_over_both_decodes_keeps_conversation_and_prefix(cluster):
    c = client(cluster)
    before, cached_before = served(cluster), prefill_cached(cluster)
    previous, turns, hits = None, [], []
    for i in range(5):
        cached = prefill_cached(cluster)
        r = c.responses.create(model="m", input=f"turn {i}: tell me more", max_output_tokens=6,
                               previous_response_id=previous)
        hits.append(prefill_cached(cluster) - cached)
        turns.append(r)
        assert r.previous_response_id == previous  # the client's own, though not sent on
        previous = r.id
    after = served(cluster)
    assert all(after[url] - before[url] >= 2 for url in cluster.decode), (before, after)
    # the servers got the whole conversation: the prompt grows by each turn's exchange
    inputs = [t.usage.input_tokens for t in turns]
    assert inputs == sorted(inputs) and inputs[-1] > inputs[0] + 4 * 6, inputs
    # ... and it renders into the same prefix: each turn reuses the previous turn's prompt
    for i in range(1, 5):
        assert hits[i] >= inputs[i - 1] - 16, (i, hits, inputs)  # (a page short at most)
    assert prefill_cached(cluster) > cached_before
    items = httpx.get(f"{cluster.gateway}/v1/responses/{turns[-1].id}/input_items",
                      params={"order": "asc"}, headers=_auth("tenant-a"), timeout=10
                      ).json()["data"]
    assert [i["role"] for i in items] == ["user", "assistant"] * 4 + ["user"]
    assert items[0]["content"] == [{"type": "input_text", "text": "turn 0: tell me more"}]
    for k in range(4):
        assert items[2 * k + 1]["content"][0]["text"] == turns[k].output_text


def test_delete_then_retrieve_and_continue_are_404(cluster):
    c = client(cluster)
    r = c.responses.create(model="m", input="to be deleted", max_output_tokens=4)
    c.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="m", input="next", previous_response_id=r.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.delete(r.id)


def test_a_response_deleted_while_it_runs_stays_deleted_when_it_ends(cluster):
    """DELETE answered `deleted: true` mid-stream; the stream's end must not write it back
    (before: its final save did, and it could be read and continued for the whole TTL)."""
    c = client(cluster)
    with c.responses.create(model="m", input="a long one", max_output_tokens=60,
                            stream=True) as stream:
        events = iter(stream)
        rid = next(events).response.id
        c.responses.delete(rid)  # (the SDK returns None; a 404 would raise)
        kinds = [event.type for event in events]
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(rid)
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="m", input="next", previous_response_id=rid)


def test_store_false_is_not_kept_and_no_server_keeps_it(cluster):
    c = client(cluster)
    r = c.responses.create(model="m", input="ephemeral", store=False, max_output_tokens=4)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)
    kept = c.responses.create(model="m", input="kept", max_output_tokens=4)
    assert kept.store is True  # kept by the gateway (the server was told store=false)
    assert c.responses.retrieve(kept.id).store is True


def test_another_tenant_sees_nothing(cluster):
    mine = client(cluster, "tenant-a").responses.create(model="m", input="secret",
                                                          max_output_tokens=4)
    other = client(cluster, "tenant-b")
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model="m", input="go on", previous_response_id=mine.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.cancel(mine.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(mine.id)
    assert client(cluster, "tenant-a").responses.retrieve(mine.id).id == mine.id


def test_background_and_owned_fields_are_refused_with_a_clear_400(cluster):
    c = client(cluster)
    with pytest.raises(openai.BadRequestError) as refused:
        c.responses.create(model="m", input="later", background=True)
    assert refused.value.code == "unsupported_background"
    assert "background" in refused.value.message
    for field in ("bootstrap_room", "request_id"):
        answer = httpx.post(cluster.gateway + "/v1/responses", headers=_auth("tenant-a"),
                            json={"model": "m", "input": "x", field: 7}, timeout=10)
        assert answer.status_code == 400 and field in answer.json()["error"]["message"]


def test_cancel_aborts_both_legs_of_a_running_stream(cluster):
    c = client(cluster)
    aborted_before = {url: cluster.stats(url)["aborted"] for url in cluster.decode}
    answer: dict = {}
    started = threading.Event()

    def run() -> None:
        with c.responses.stream(model="m", input="a long one",
                                max_output_tokens=3000) as stream:
            for event in stream:
                if event.type == "response.created":
                    answer["id"] = event.response.id
                elif event.type == "response.output_text.delta":
                    started.set()  # the decode generates: its prefill leg is done
                answer["last"] = event.type

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    assert started.wait(20)
    cancelled = c.responses.cancel(answer["id"])
    assert cancelled.status == "cancelled"
    worker.join(20)
    assert not worker.is_alive()  # the stream ended long before its 3000 tokens (30 s)
    assert c.responses.retrieve(answer["id"]).status == "cancelled"
    aborted = {url: cluster.stats(url)["aborted"] - aborted_before[url] for url in cluster.decode}
    assert sum(aborted.values()) == 1, aborted
    prefill = cluster.stats(cluster.prefill[0][0])
    assert prefill["in_flight"] == 0


def test_openai_agents_sdk_runs_a_conversation(cluster):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)

    async def converse() -> tuple:
        model = agents.OpenAIResponsesModel(model="m", openai_client=openai.AsyncOpenAI(
            base_url=cluster.gateway + "/v1", api_key=KEYS["tenant-a"], max_retries=0))
        # the sim ends an answer only at a stop string: one of its syllables' vowels
        settings = agents.ModelSettings(max_tokens=64, extra_body={"stop": ["o", "u"]})
        agent = agents.Agent(name="helper", instructions="Answer briefly.", model=model,
                             model_settings=settings)
        first = await agents.Runner.run(agent, "Hello there")
        second = await agents.Runner.run(agent, "And then?",
                                         previous_response_id=first.last_response_id)
        return first, second

    first, second = asyncio.run(converse())
    assert isinstance(first.final_output, str) and first.final_output
    assert second.final_output and second.last_response_id != first.last_response_id
    items = httpx.get(f"{cluster.gateway}/v1/responses/{second.last_response_id}/input_items",
                      headers=_auth("tenant-a"), timeout=10).json()["data"]
    assert len(items) == 3  # Hello there, the first answer, And then?


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer wrong"}],
                         ids=["no-key", "wrong-key"])
def test_a_caller_without_an_inference_key_is_refused(cluster, headers):
    for method, path in [("POST", "/v1/responses"), ("GET", "/v1/responses/resp_1"),
                         ("POST", "/v1/responses/resp_1/cancel")]:
        answer = httpx.request(method, cluster.gateway + path, headers=headers, timeout=10,
                               json={"model": "m", "input": "x"})
        assert answer.status_code == 401, (path, answer.text)
        assert answer.json()["error"]["type"] == "authentication_error"


def test_a_failing_decode_is_retried_before_the_first_event(cluster):
    bad = cluster.decode[0]
    httpx.post(bad + "/sim/faults", json={"error_rate": 1.0}, timeout=5).raise_for_status()
    try:
        c = client(cluster)
        failed_before = cluster.stats(bad)["faults_applied"].get("error_rate", 0)
        for _ in range(2):  # round robin: one of them meets the failing decode first
            with c.responses.stream(model="m", input="retry me", max_output_tokens=4) as s:
                kinds = [event.type for event in s]
            assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"
            assert "error" not in kinds
        assert cluster.stats(bad)["faults_applied"].get("error_rate", 0) > failed_before
    finally:
        cluster.reset()


def test_a_chain_past_half_the_context_is_counted_served_then_refused_by_its_count(tmp_path):
    """The context check counts a Responses turn as the chat SGLang makes of it (history
    included): turns that fit are served up to the context, and the one that does not is a
    400 naming the numbers (before: past half the context nothing counted it, so every turn
    got a 503 "retry shortly", and so did every retry)."""
    with sim_cluster(tmp_path, sim_args=["--token-delay", "0.001", "--context-length",
                                         "4096"]) as c:
        previous, served = None, []
        for _ in range(9):  # about 640 tokens a turn: the 7th passes 4096
            body = {"model": "sim-model", "input": "word " * 500, "max_output_tokens": 4}
            if previous is not None:
                body["previous_response_id"] = previous
            answer = httpx.post(c.gateway + "/v1/responses", json=body, timeout=30)
            if answer.status_code != 200:
                break
            previous = answer.json()["id"]
            served.append(answer.json()["usage"]["input_tokens"])
    assert len(served) >= 5 and served[-1] > 3000, served
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["code"] == "context_length_exceeded", answer.text


def test_a_stream_whose_cancel_won_ends_cancelled_as_its_record_and_the_cancel_say(cluster):
    """The cancel wins the record while the turn runs: the stream's last event (SGLang's
    answer to the abort) reaches the client as `cancelled`, which GET and the cancel's own
    answer also say (before: the client read `failed` while the others said cancelled)."""
    c = client(cluster)
    seen: dict = {}
    started = threading.Event()

    def run() -> None:
        with c.responses.stream(model="m", input="cancel me", max_output_tokens=3000) as s:
            for event in s:
                if event.type == "response.created":
                    seen["id"] = event.response.id
                elif event.type == "response.output_text.delta":
                    started.set()
                elif event.type in ("response.completed", "response.incomplete",
                                    "response.failed"):
                    seen["last"] = event.response.status

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    assert started.wait(20)
    answered = c.responses.cancel(seen["id"]).status
    worker.join(20)
    assert not worker.is_alive()  # ended long before its 3000 tokens (30 s)
    record = c.responses.retrieve(seen["id"]).status
    assert (seen.get("last"), answered, record) == ("cancelled",) * 3
