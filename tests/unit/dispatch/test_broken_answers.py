"""A broken upstream answer is never relayed as a success: a non-streamed body cut off or
stalled halfway, a stream that ends inside an event, a decode silent once its KV is there
(gateway/dispatch/whole_body.py, gateway/dispatch/relay.py, gateway/dispatch/pd.py)."""

from __future__ import annotations

import asyncio
import time

import orjson

from tests.unit.fakes import FakeCluster, FakeServer, run, served_client, served_gateway

P1 = "http://127.0.0.1:30000"
D1, D2 = "http://127.0.0.1:30001", "http://127.0.0.1:30003"
GOOD = orjson.dumps({"id": "x", "choices": [{"index": 0, "message": {"content": "ok"}}],
                     "usage": {"prompt_tokens": 3, "completion_tokens": 1}})
CUT = GOOD[: len(GOOD) // 2] + b"}"  # ends on a brace: a scan for one would pass it
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def cluster(d1: FakeServer, d2: FakeServer | None = None) -> FakeCluster:
    servers = {P1: FakeServer("prefill"), D1: d1}
    if d2 is not None:
        servers[D2] = d2
    return FakeCluster(servers)


def test_a_cut_off_body_is_retried_on_another_decode():
    fakes = cluster(FakeServer("decode", whole=[CUT]), FakeServer("decode", whole=[GOOD]))

    async def go():
        async with served_client(fakes) as client:
            answers = [await client.post("/v1/chat/completions", json=CHAT) for _ in range(4)]
        assert [r.status_code for r in answers] == [200] * 4
        assert all(r.content == GOOD for r in answers)
        assert fakes.servers[D1].received  # the broken decode was tried
    run(go())


def test_a_cut_off_body_from_the_only_decode_is_a_502_not_a_200():
    fakes = cluster(FakeServer("decode", whole=[CUT]))

    async def go():
        async with served_client(fakes, "--max-attempts", "2") as client:
            r = await client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 502
        assert "not whole JSON" in r.json()["error"]["message"]
    run(go())


def test_a_body_that_stops_halfway_without_closing_is_retried_within_the_gap_deadline():
    half = GOOD[:20]
    fakes = cluster(FakeServer("decode", whole=[half, b"<hang>"]),
                    FakeServer("decode", whole=[GOOD]))

    async def go():
        async with served_client(fakes, "--stream-idle-timeout", "0.3") as client:
            started = time.monotonic()
            answers = await asyncio.gather(*(client.post("/v1/chat/completions", json=CHAT)
                                             for _ in range(2)))
            took = time.monotonic() - started
        assert [r.content for r in answers] == [GOOD, GOOD]
        assert fakes.servers[D1].received
        assert took < 5  # the hard response timeout is 600 s
    run(go())


def test_a_stream_ending_inside_an_event_never_shows_the_cut_data():
    good = b'data: {"id":"s","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
    cut = b'data: {"id":"s","choices":[{"index":0,"delta":{"cont'
    fakes = cluster(FakeServer("decode", chunks=[good, cut]))

    async def go():
        async with served_client(fakes, "--no-midstream-failover") as client:
            r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert r.status_code == 200
        assert r.content.count(b'"cont') == 1  # the good event's only
        events = [e for e in r.content.split(b"\n\n") if e]
        assert events[0] == good.strip()
        assert b"cut off" in events[1] and events[-1] == b"data: [DONE]"
        for event in events[:-1]:
            orjson.loads(event[len(b"data: "):])  # every event the client got is whole
    run(go())


def test_a_non_streamed_decode_silent_once_its_kv_is_there_is_bounded_by_its_speed():
    """The decode's per-token gap is learned (here, told); a request for 4 tokens whose
    prefill answered gets factor x gap x 5 (floored) of silence, not the response timeout,
    and is retried on the other decode."""
    fakes = cluster(FakeServer("decode", hang=True), FakeServer("decode", whole=[GOOD]))

    async def go():
        async with served_gateway(fakes, "--hang-floor", "0.2") as (client, gw):
            model = gw.dispatcher.model
            for url in (D1, D2):
                for _ in range(10):
                    model.gap(model.gaps_of(url), 0.01)
            started = time.monotonic()
            answers = await asyncio.gather(*(client.post("/v1/chat/completions", json=CHAT)
                                             for _ in range(2)))
            took = time.monotonic() - started
        assert [r.status_code for r in answers] == [200, 200]
        assert fakes.servers[D1].received
        assert took < 5
    run(go())


def test_a_stream_whose_first_event_is_cut_is_retried_before_the_client_sees_anything():
    good = [b'data: {"id":"s","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n',
            b"data: [DONE]\n\n"]
    fakes = cluster(FakeServer("decode", chunks=[b'data: {"id":"s","cho']),
                    FakeServer("decode", chunks=good))

    async def go():
        async with served_client(fakes, "--no-midstream-failover") as client:
            answers = [await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
                       for _ in range(2)]
        assert [r.content for r in answers] == [b"".join(good)] * 2
        assert fakes.servers[D1].received
    run(go())


def test_a_prefill_answer_cut_after_its_head_does_not_fail_the_request():
    """The prefill computed (it answered 200); its body was cut. The decode says whether the
    KV came: here it did, so the client gets the decode's answer, and the prefill's breaker
    hears of the failure."""
    fakes = FakeCluster({P1: FakeServer("prefill", whole=[b'{"te', b"<error>"]),
                         D1: FakeServer("decode", whole=[GOOD], delay=0.3)})

    async def go():
        async with served_gateway(fakes, "--max-attempts", "1") as (client, gw):
            r = await client.post("/v1/chat/completions", json=CHAT)
            return r, gw.pool.get(P1).breaker.consecutive_failures

    r, prefill_failures = run(go())
    assert r.status_code == 200 and r.content == GOOD
    assert prefill_failures == 1


def test_a_streamed_prefill_cut_before_its_answer_is_retried_not_waited_for():
    """A streamed prefill leg's 200 head comes before any work (SGLang starts the event
    stream at once): cut before its answer event, the prefill died with the request, and
    its decode would wait for KV that never comes. The attempt fails at once and the request
    is retried on the other prefill; the client sees only the good stream."""
    p2 = "http://127.0.0.1:30002"
    event = b'data: {"text": "ok", "meta_info": {"id": "x"}}\n\n'
    done = [event, b"data: [DONE]\n\n"]
    waits = []  # the first decode leg is the dead prefill's: its KV never comes

    def kv_never_comes(body: dict) -> bool:
        waits.append(body["bootstrap_room"])
        return len(waits) == 1

    fakes = FakeCluster({P1: FakeServer("prefill", chunks=[b"<error>"]),
                         p2: FakeServer("prefill", chunks=done),
                         D1: FakeServer("decode", chunks=done, hang_if=kv_never_comes)})
    ask = {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 1}}

    async def go():
        async with served_gateway(fakes) as (client, gw):
            started = time.monotonic()
            r = await client.post("/generate", json=ask)
            return r, time.monotonic() - started, gw.pool.get(P1).breaker.consecutive_failures

    r, took, p1_failures = run(go(), timeout=30)
    assert r.status_code == 200 and b'"ok"' in r.content
    assert len(fakes.servers[P1].received) == 1 and len(fakes.servers[p2].received) == 1
    assert fakes.servers[D1].cancelled == 1  # the waiting decode leg was stopped
    assert took < 2.0  # not held until the decode's deadline
    assert p1_failures == 1


def test_a_client_rid_split_across_two_reads_is_still_cut_from_the_answer():
    """The servers get the client's rid with a random suffix (rids must be unique there) and
    the gateway cuts it from the answer. It cut it from each read before joining a partial
    event to the next read: a suffix split between two reads reached the client."""
    def split_in_the_rid(body: dict) -> list[bytes]:
        rid = body["rid"].encode()
        event = (b'data: {"id":"' + rid + b'","choices":[{"index":0,"delta":'
                 b'{"content":"a"}}]}\n\n')
        at = event.index(rid) + len(rid) - 5  # inside the suffix
        return [event, event[:at], b"<pause>", event[at:], b"data: [DONE]\n\n"]

    fakes = cluster(FakeServer("decode", chunks=split_in_the_rid))

    async def go():
        async with served_client(fakes) as client:
            r = await client.post("/v1/chat/completions",
                                  json={**CHAT, "stream": True, "rid": "client-rid"})
        assert r.status_code == 200
        sent = fakes.servers[D1].received[0]["rid"]
        assert sent.startswith("client-rid") and sent != "client-rid"  # it was suffixed
        events = [orjson.loads(e[len(b"data: "):]) for e in r.content.split(b"\n\n")[:2]]
        assert [e["id"] for e in events] == ["client-rid", "client-rid"]
    run(go())
