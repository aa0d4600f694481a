"""The PD rules, enforced like SGLang, between a real prefill and decode sim."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
from typing import Any

import httpx
import pytest

from tests.sim.conftest import PD_FLAGS
from tests.sim.simproc import HOST, Sim, free_port, wait_until

pytestmark = pytest.mark.timeout(60)

PROMPT = "The quick brown fox jumps over the lazy dog"


def body(prefill: Sim, room: int | list[int], **extra: Any) -> dict[str, Any]:
    out = {"text": PROMPT, "sampling_params": {"max_new_tokens": 8}, **prefill.pd_fields(room)}
    out.update(extra)
    return out


async def _both(prefill: Sim, decode: Sim, payload: dict[str, Any], path: str = "/generate",
                stagger: float = 0.0) -> tuple[httpx.Response, httpx.Response]:
    async with httpx.AsyncClient(timeout=15) as client:
        p = asyncio.create_task(client.post(prefill.url + path, json=payload))
        await asyncio.sleep(stagger)
        d = asyncio.create_task(client.post(decode.url + path, json=payload))
        return await p, await d


def pd(prefill: Sim, decode: Sim, payload: dict[str, Any], **kw: Any) -> tuple[httpx.Response, httpx.Response]:
    return asyncio.run(_both(prefill, decode, payload, **kw))


def timed(fn: Any, *args: Any, **kw: Any) -> tuple[float, Any]:
    start = time.monotonic()
    result = fn(*args, **kw)
    return time.monotonic() - start, result


def test_manual_pd_request_succeeds_and_matches_plain_server(pd_pair, null_sim, room):
    prefill, decode = pd_pair
    p, d = pd(prefill, decode, body(prefill, room()))
    assert p.status_code == 200 and d.status_code == 200
    pm, dm = p.json()["meta_info"], d.json()["meta_info"]
    assert pm["finish_reason"] == {"type": "length", "length": 0}
    assert pm["completion_tokens"] == 1
    assert dm["finish_reason"] == {"type": "length", "length": 8}
    assert dm["completion_tokens"] == 8 and dm["prompt_tokens"] == pm["prompt_tokens"]
    # The first token comes from the prefill; decode continues from it.
    assert d.json()["output_ids"][0] == p.json()["output_ids"][0]
    plain = null_sim.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 8}})
    assert plain.json()["text"] == d.json()["text"]
    # Deterministic: a second pair with a new room gives the same text.
    _, d2 = pd(prefill, decode, body(prefill, room()))
    assert d2.json()["text"] == d.json()["text"]


def test_decode_may_arrive_first(pd_pair, room):
    prefill, decode = pd_pair
    async def decode_first() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(timeout=15) as client:
            payload = body(prefill, room())
            d = asyncio.create_task(client.post(decode.url + "/generate", json=payload))
            await asyncio.sleep(0.3)
            p = await client.post(prefill.url + "/generate", json=payload)
            return p, await d
    p, d = asyncio.run(decode_first())
    assert p.status_code == 200 and d.status_code == 200


@pytest.mark.parametrize("target", ["prefill", "decode"])
def test_missing_room_is_400(pd_pair, target):
    prefill, decode = pd_pair
    sim = prefill if target == "prefill" else decode
    r = sim.post("/generate", json={"text": "hi", "rid": "no-room"})
    assert r.status_code == 400
    assert r.json() == {"error": {"message": "Invalid request: Disaggregated request received "
                                             "without bootstrap room id. req.rid='no-room'"}}


def test_decode_without_prefill_fails_after_waiting_timeout(pd_pair, room):
    prefill, decode = pd_pair
    elapsed, r = timed(decode.post, "/generate", json=body(prefill, room()))
    assert r.status_code == 500
    err = r.json()
    assert err["object"] == "error" and err["code"] == 500
    assert err["message"].startswith("Decode transfer failed")
    assert "KVPoll.WaitingForInput" in err["message"]
    assert 0.9 <= elapsed < 5


def test_prefill_keeps_tombstone_after_decode_timeout(pd_pair, room):
    prefill, decode = pd_pair
    number = room()
    assert decode.post("/generate", json=body(prefill, number)).status_code == 500
    assert wait_until(lambda: prefill.room_state(number) == "failed")
    elapsed, r = timed(prefill.post, "/generate", json=body(prefill, number))
    assert r.status_code == 500 and elapsed < 0.5
    assert "Duplicate or cancelled bootstrap room" in r.json()["message"]


def test_prefill_without_decode_fails_after_bootstrap_timeout(pd_pair, room):
    prefill, _ = pd_pair
    elapsed, r = timed(prefill.post, "/generate", json=body(prefill, room()))
    assert r.status_code == 500
    assert r.json()["message"].startswith("Prefill bootstrap failed")
    assert "KVPoll.Bootstrapping" in r.json()["message"]
    assert 1.4 <= elapsed < 5


def test_wrong_bootstrap_port_fails_after_retries(pd_pair, room):
    prefill, decode = pd_pair
    payload = body(prefill, room(), bootstrap_port=free_port())
    elapsed, r = timed(decode.post, "/generate", json=payload)
    assert r.status_code == 500
    assert r.json()["message"].startswith("Decode handshake failed")
    assert r.json()["message"].endswith("Aborted by AbortReq.")
    assert 0.35 <= elapsed < 3  # 3 attempts, 0.2 s apart


def test_bootstrap_port_of_a_non_prefill_server_fails(pd_pair, null_sim, room):
    prefill, decode = pd_pair
    payload = body(prefill, room(), bootstrap_port=null_sim.port)
    r = decode.post("/generate", json=payload)
    assert r.status_code == 500 and "Decode handshake failed" in r.json()["message"]


def test_duplicate_concurrent_room_on_decode_fails_one(pd_pair, room):
    prefill, decode = pd_pair
    payload = body(prefill, room())

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=15) as client:
            return await asyncio.gather(
                client.post(decode.url + "/generate", json=payload),
                client.post(decode.url + "/generate", json=payload),
                client.post(prefill.url + "/generate", json=payload),
            )
    d1, d2, p = asyncio.run(run())
    codes = sorted([d1.status_code, d2.status_code])
    assert codes == [200, 500] and p.status_code == 200
    failed = d1 if d1.status_code == 500 else d2
    assert "Duplicate decode bootstrap room" in failed.json()["message"]


def test_room_reuse_after_completion_fails(pd_pair, room):
    prefill, decode = pd_pair
    payload = body(prefill, room())
    p, d = pd(prefill, decode, payload)
    assert p.status_code == d.status_code == 200
    p2, d2 = pd(prefill, decode, payload)
    assert p2.status_code == 500 and d2.status_code == 500


def test_cancelled_prefill_fails_decode_promptly(pd_pair, room):
    prefill, decode = pd_pair
    number = room()
    with pytest.raises(httpx.ReadTimeout):
        prefill.post("/generate", json=body(prefill, number), timeout=0.3)
    assert wait_until(lambda: prefill.room_state(number) == "failed")
    elapsed, r = timed(decode.post, "/generate", json=body(prefill, number))
    assert r.status_code == 500 and elapsed < 0.5
    outcomes = {(x["room"], x["outcome"]) for x in prefill.stats()["rooms"]}
    assert (number, "cancelled") in outcomes


def test_cancelled_decode_fails_waiting_prefill_promptly(pd_pair, room):
    prefill, decode = pd_pair
    number = room()
    with pytest.raises(httpx.ReadTimeout):  # decode joins the room, then its client leaves
        decode.post("/generate", json=body(prefill, number), timeout=0.3)
    assert wait_until(lambda: prefill.room_state(number) == "failed")
    elapsed, r = timed(prefill.post, "/generate", json=body(prefill, number))
    assert r.status_code == 500 and elapsed < 0.5


def test_streaming_pd_failure_is_an_abort_chunk(pd_pair, room):
    prefill, decode = pd_pair
    r = decode.post("/generate", json=body(prefill, room(), stream=True))
    assert r.status_code == 200
    events = [line[6:] for line in r.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert last["meta_info"]["finish_reason"]["status_code"] == 500


def test_batch_pd_one_room_per_item(pd_pair, null_sim, room):
    prefill, decode = pd_pair
    prompts = ["first prompt here", "second prompt, longer than the first"]
    rooms = [room(), room()]
    payload = {"text": prompts, "sampling_params": {"max_new_tokens": 4}, **prefill.pd_fields(rooms)}
    p, d = pd(prefill, decode, payload)
    assert p.status_code == 200 and d.status_code == 200
    assert [x["meta_info"]["finish_reason"]["length"] for x in p.json()] == [0, 0]
    plain = null_sim.post("/generate", json={"text": prompts, "sampling_params": {"max_new_tokens": 4}})
    assert [x["text"] for x in d.json()] == [x["text"] for x in plain.json()]
    seen = {x["room"] for x in decode.stats()["rooms"] if x["outcome"] == "completed"}
    assert set(rooms) <= seen


def test_scalar_room_with_batch_expands_to_room_plus_index(pd_pair, room):
    prefill, decode = pd_pair
    base = room()
    room()  # reserve base + 1
    payload = {"text": ["a b c d", "e f g h"], "sampling_params": {"max_new_tokens": 2},
               **prefill.pd_fields(base)}
    p, d = pd(prefill, decode, payload)
    assert p.status_code == 200 and d.status_code == 200
    seen = {x["room"] for x in prefill.stats()["rooms"]}
    assert {base, base + 1} <= seen


def test_pd_logprobs_input_on_prefill_output_on_decode(pd_pair, room):
    prefill, decode = pd_pair
    payload = body(prefill, room(), return_logprob=True, logprob_start_len=0)
    p, d = pd(prefill, decode, payload)
    pm, dm = p.json()["meta_info"], d.json()["meta_info"]
    assert len(pm["input_token_logprobs"]) == pm["prompt_tokens"]
    assert pm["input_token_logprobs"][0][0] is None
    assert dm["input_token_logprobs"] == []
    assert len(dm["output_token_logprobs"]) == 8
    assert dm["output_token_logprobs"][0] == pm["output_token_logprobs"][0]


def test_pd_openai_chat(pd_pair, room):
    prefill, decode = pd_pair
    payload = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5,
               **prefill.pd_fields(room())}
    p, d = pd(prefill, decode, payload, path="/v1/chat/completions")
    assert p.status_code == 200 and d.status_code == 200
    assert d.json()["usage"]["completion_tokens"] == 5
    assert d.json()["choices"][0]["finish_reason"] == "length"


def test_prefill_bootstrap_server_routes(pd_pair):
    prefill, _ = pd_pair
    base = f"http://{HOST}:{prefill.bootstrap_port}"
    assert httpx.get(base + "/health").text == "OK"
    info = httpx.get(base + "/route", params={"prefill_dp_rank": -1, "prefill_cp_rank": -1,
                                             "target_tp_rank": -1, "target_pp_rank": -1}).json()
    assert info["dp_size"] == 1 and info["page_size"] == 1
    assert httpx.get(base + "/route").status_code == 400


def test_prefill_death_fails_waiting_decode_promptly(sim_factory, room):
    prefill = sim_factory("prefill", "--bootstrap-timeout", "20")
    decode = sim_factory("decode", "--waiting-timeout", "20")
    number = room()

    async def run() -> tuple[float, httpx.Response]:
        async with httpx.AsyncClient(timeout=15) as client:
            task = asyncio.create_task(client.post(decode.url + "/generate", json=body(prefill, number)))
            assert await asyncio.to_thread(wait_until, lambda: prefill.room_state(number) == "open")
            os.killpg(prefill.popen.pid, signal.SIGKILL)
            killed = time.monotonic()
            r = await task
            return time.monotonic() - killed, r
    elapsed, r = asyncio.run(run())
    assert r.status_code == 500 and elapsed < 2
    assert r.json()["message"].startswith("Decode transfer failed")
    assert "Lost connection with prefill instance" in r.json()["message"]


def test_second_decode_server_cannot_join_a_taken_room(pd_pair, sim_factory, room):
    prefill, decode = pd_pair
    other = sim_factory("decode")
    payload = body(prefill, room())

    async def run() -> tuple[httpx.Response, float, httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(timeout=15) as client:
            first = asyncio.create_task(client.post(decode.url + "/generate", json=payload))
            room_number = payload["bootstrap_room"]
            assert await asyncio.to_thread(
                wait_until, lambda: prefill.room_state(room_number) == "open")
            start = time.monotonic()
            second = await client.post(other.url + "/generate", json=payload)
            elapsed = time.monotonic() - start
            p = await client.post(prefill.url + "/generate", json=payload)
            return second, elapsed, p, await first
    second, elapsed, p, first = asyncio.run(run())
    assert second.status_code == 500 and elapsed < 0.5
    assert second.json()["message"].startswith("Decode handshake failed")
    assert "Duplicate decode bootstrap room" in second.json()["message"]
    assert p.status_code == 200 and first.status_code == 200


def test_bootstrap_port_speaks_plain_http_and_refuses_foreign_upgrades(pd_pair, room):
    prefill, _ = pd_pair
    base = f"http://{HOST}:{prefill.bootstrap_port}"
    with httpx.Client(timeout=5) as client:  # keep-alive: several requests on one connection
        assert client.get(base + "/health").text == "OK"
        ranks = {"prefill_dp_rank": 0, "prefill_cp_rank": 0, "target_tp_rank": 0, "target_pp_rank": 0}
        assert client.get(base + "/route", params=ranks).json() == {
            "rank_ip": HOST, "rank_port": prefill.bootstrap_port}
        assert client.get(base + "/route", params={**ranks, "prefill_dp_rank": 3}).status_code == 404
        assert client.put(base + "/route").text == "OK"
        assert client.post(base + "/register_dp_rank", json={}).status_code == 500  # KeyError
        unknown, registered = room(), room()
        assert client.post(base + "/register_dp_rank",
                           json={"bootstrap_room": registered, "dp_rank": 0}).text == "OK"
        assert client.post(base + "/query_dp_ranks",
                           json={"bootstrap_rooms": [unknown, registered]}).json() == {
            str(registered): 0}
        assert client.get(base + f"/sim/rooms/{unknown}").status_code == 404
        assert client.get(base + "/nowhere").status_code == 404
    with socket.create_connection((HOST, prefill.bootstrap_port), timeout=5) as s:
        s.sendall(b"GET /sim/kv HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 400")


async def _first_event_at(client: httpx.AsyncClient, url: str, payload: dict[str, Any],
                          started: float) -> tuple[float, float]:
    """Seconds from `started` to a stream's first data event and to its end."""
    first = None
    async with client.stream("POST", url, json=payload) as answer:
        assert answer.status_code == 200
        async for line in answer.aiter_lines():
            if line.startswith("data:") and first is None:
                first = time.monotonic() - started
    assert first is not None
    return first, time.monotonic() - started


def test_a_request_queued_for_room_on_the_decode_streams_its_first_token_when_it_joins(
        sim_factory, room):
    """SGLang's decode streams the prefill's first token when the request joins a batch
    (`process_batch_result_prebuilt`), not when its KV arrives: with one running slot, the
    second request shows nothing until the first has finished."""
    prefill = sim_factory("prefill", *PD_FLAGS, "--fast")
    decode = sim_factory("decode", *PD_FLAGS, "--token-delay", "0.04",
                         "--max-running-requests", "1")

    async def run() -> tuple[tuple[float, float], tuple[float, float]]:
        started = time.monotonic()
        async with httpx.AsyncClient(timeout=15) as client:
            async def one(number: int, delay: float) -> tuple[float, float]:
                await asyncio.sleep(delay)
                payload = {**body(prefill, number), "stream": True,
                           "sampling_params": {"max_new_tokens": 20}}
                leg = asyncio.create_task(client.post(prefill.url + "/generate", json=payload))
                got = await _first_event_at(client, decode.url + "/generate", payload, started)
                assert (await leg).status_code == 200
                return got
            return tuple(await asyncio.gather(one(room(), 0.0), one(room(), 0.2)))

    (_, first_end), (second_first, _) = asyncio.run(run())
    assert second_first >= first_end - 0.05  # 19 steps of 40 ms after the first one's start
