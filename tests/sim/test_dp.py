"""Data parallelism inside one server: DP ranks, their routing, and what PD pairing needs of them."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import httpx
import msgpack
import pytest
import zmq

from backends.launcher.ports import is_port_free, quiet_ports
from backends.sim.config import config_from_args
from backends.sim.dp import CONTROLLER_CRASH_EXIT_CODE
from tests.sim.conftest import PD_FLAGS
from tests.sim.simproc import HOST, Sim, wait_until

pytestmark = pytest.mark.timeout(60)

PROMPT = "Data parallel ranks each keep their own cache"


def body(prefill: Sim, number: int, **extra: Any) -> dict[str, Any]:
    return {"text": PROMPT, "sampling_params": {"max_new_tokens": 3}, **prefill.pd_fields(number),
            **extra}


async def _pairs(prefill: Sim, decode: Sim, bodies: list[tuple[dict[str, Any], dict[str, Any]]]
                 ) -> list[tuple[httpx.Response, httpx.Response]]:
    async with httpx.AsyncClient(timeout=20) as client:
        legs = [asyncio.gather(client.post(prefill.url + "/generate", json=p),
                               client.post(decode.url + "/generate", json=d)) for p, d in bodies]
        return [tuple(x) for x in await asyncio.gather(*legs)]  # type: ignore[misc]


def pairs(prefill: Sim, decode: Sim, *bodies: dict[str, Any] | tuple[dict[str, Any], dict[str, Any]]
          ) -> list[tuple[httpx.Response, httpx.Response]]:
    legs = [b if isinstance(b, tuple) else (b, b) for b in bodies]
    return asyncio.run(_pairs(prefill, decode, legs))


def rank_requests(sim: Sim) -> list[int]:
    return [r["requests"] for r in sim.stats()["dp_ranks"]]


def free_port_run(count: int) -> int:
    """A base port with `count` free consecutive ports (KV events bind base + rank).

    Taken from the launcher's quiet ranges, below the kernel's ephemeral range: a run found
    by bind(0) lies in that range, where the suite's own outgoing connections can take one of
    its ports before the simulator binds it (CI, 2026-12-05: "Address already in use").
    """
    candidates = quiet_ports()  # shuffled
    quiet = set(candidates)
    for base in candidates:
        run = range(base, base + count)
        if quiet.issuperset(run) and all(is_port_free(HOST, port) for port in run):
            return base
    raise RuntimeError("no free port run")


@pytest.fixture(scope="module")
def dp_pair():
    """A 2-rank prefill (follow_bootstrap_room, its default) and a 2-rank decode (round_robin)."""
    prefill = Sim("prefill", *PD_FLAGS, "--dp-size", "2")
    try:
        decode = Sim("decode", *PD_FLAGS, "--dp-size", "2")
    except BaseException:
        prefill.stop()
        raise
    yield prefill, decode
    decode.stop()
    prefill.stop()


# ---- flags and what the server reports ----

def test_load_balance_method_defaults_and_dp_attention_layout():
    assert config_from_args(["--mode", "prefill"]).load_balance_method == "follow_bootstrap_room"
    assert config_from_args(["--mode", "decode"]).load_balance_method == "round_robin"
    assert config_from_args([]).load_balance_method == "round_robin"
    cfg = config_from_args(["--mode", "prefill", "--load-balance-method", "total_tokens"])
    assert cfg.load_balance_method == "total_tokens"
    attn = config_from_args(["--dp-size", "4", "--enable-dp-attention"])
    assert (attn.num_dp_ranks, attn.dp_size, attn.attn_dp_size) == (4, 1, 4)
    with pytest.raises(SystemExit):
        config_from_args(["--dp-size", "2", "--attn-dp-size", "2"])


def test_server_info_loads_and_metrics_per_rank(dp_pair):
    prefill, _ = dp_pair
    info = prefill.get("/server_info").json()
    assert info["dp_size"] == 2 and info["attn_dp_size"] == 1
    assert info["enable_dp_attention"] is False
    assert info["load_balance_method"] == "follow_bootstrap_room"
    assert [s["dp_rank"] for s in info["internal_states"]] == [0, 1]
    loads = prefill.get("/v1/loads", params={"include": "core"}).json()["loads"]
    assert [x["dp_rank"] for x in loads] == [0, 1]
    assert [x["dp_rank"] for x in prefill.get("/v1/loads?dp_rank=1").json()["loads"]] == [1]
    assert prefill.get("/v1/loads?dp_rank=2").json()["loads"] == []
    metrics = prefill.get("/metrics").text
    for rank in (0, 1):
        assert f'sglang:num_running_reqs{{model_name="sim-model",engine_type="prefill",' \
               f'tp_rank="0",pp_rank="0",moe_ep_rank="0",dp_rank="{rank}"}}' in metrics
    route = httpx.get(f"http://{HOST}:{prefill.bootstrap_port}/route", params={
        "prefill_dp_rank": -1, "prefill_cp_rank": -1, "target_tp_rank": -1,
        "target_pp_rank": -1}).json()
    assert route["dp_size"] == 2 and route["follow_bootstrap_room"] is True


def test_dp_attention_reports_attn_dp_size(sim_factory):
    sim = sim_factory("null", "--dp-size", "2", "--enable-dp-attention")
    info = sim.get("/server_info").json()
    assert (info["dp_size"], info["attn_dp_size"], info["enable_dp_attention"]) == (1, 2, True)
    assert len(info["internal_states"]) == 2


# ---- routing ----

def room_of(room, parity: int) -> int:
    """A fresh room with room % 2 == parity."""
    while (number := room()) % 2 != parity:
        pass
    return number


def test_follow_bootstrap_room_spreads_rooms_by_modulo(dp_pair, room):
    """With the rank named too (disagg_prefill_dp_rank, which a plain-DP prefill needs in
    0.5.23: see the next test), room % 2 picks the rank."""
    prefill, decode = dp_pair
    before = rank_requests(prefill)
    numbers = [room() for _ in range(5)]
    for p, d in pairs(prefill, decode, *[body(prefill, n, disagg_prefill_dp_rank=n % 2)
                                         for n in numbers]):
        assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
    after = rank_requests(prefill)
    odd = sum(n % 2 for n in numbers)
    assert [after[0] - before[0], after[1] - before[1]] == [5 - odd, odd]
    states = [httpx.get(f"http://{HOST}:{prefill.bootstrap_port}/sim/rooms/{n}").json()
              for n in numbers]
    assert [s["dp_rank"] for s in states] == [n % 2 for n in numbers]


def test_plain_dp_prefill_fails_rooms_off_rank_0_without_the_rank_hint(dp_pair, room):
    """0.5.23's CommonKVSender compares room % N with kv_mgr.attn_dp_rank, which is 0 on every
    plain-DP replica: odd rooms fail at once (seen on real SGLang on the CPU rig)."""
    prefill, decode = dp_pair
    even, odd = room_of(room, 0), room_of(room, 1)
    [(p, d)] = pairs(prefill, decode, body(prefill, even))
    assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
    [(p, d)] = pairs(prefill, decode, body(prefill, odd))
    assert p.status_code == 500
    assert f"dispatched to dp_rank 0 but bootstrap_room {odd} implies dp_rank 1" \
        in p.json()["message"]
    assert d.status_code == 500  # its KV never comes
    hinted = room_of(room, 1)
    [(p, d)] = pairs(prefill, decode, body(prefill, hinted, disagg_prefill_dp_rank=1))
    assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)


def test_routed_dp_rank_out_of_range_is_a_400(dp_pair, null_sim, room):
    prefill, _ = dp_pair
    r = prefill.post("/generate", json=body(prefill, room(), routed_dp_rank=2))
    assert r.status_code == 400
    assert r.json() == {"error": {"message": "routed_dp_rank=2 out of range [0, 2)"}}
    old = prefill.post("/generate", json=body(prefill, room(), data_parallel_rank=-1))
    assert old.json() == {"error": {"message": "routed_dp_rank=-1 out of range [0, 2)"}}
    # one rank: 0 is ignored, anything else out of range
    assert null_sim.post("/generate", json={"text": "x", "routed_dp_rank": 0}).status_code == 200
    r = null_sim.post("/v1/completions", json={"prompt": "x", "routed_dp_rank": 1})
    assert r.status_code == 400 and r.json()["message"] == "routed_dp_rank=1 out of range [0, 1)"


def test_routed_dp_rank_against_the_room_fails_the_prefill(dp_pair, room):
    prefill, decode = dp_pair
    number = room_of(room, 1)
    wrong = 0
    start = time.monotonic()
    [(p, d)] = pairs(prefill, decode, (body(prefill, number, routed_dp_rank=wrong),
                                       body(prefill, number)))
    assert p.status_code == 500
    assert p.json()["message"].endswith(
        f"follow_bootstrap_room conflict: dispatched to dp_rank {wrong} but bootstrap_room "
        f"{number} implies dp_rank {number % 2}. Set "
        "SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK=1 to allow mixed routing.")
    # the decode looks for the KV on rank room % 2, where nobody computes it
    assert d.status_code == 500 and "KVPoll.WaitingForInput" in d.json()["message"]
    assert time.monotonic() - start < 5


def test_routed_rank_with_disagg_prefill_dp_rank_pairs(dp_pair, room):
    """Routing a prefill off its room is fine once both legs name the prefill rank."""
    prefill, decode = dp_pair
    number = room()
    wrong = 1 - number % 2
    hint = {"disagg_prefill_dp_rank": wrong}
    [(p, d)] = pairs(prefill, decode, (body(prefill, number, routed_dp_rank=wrong, **hint),
                                       body(prefill, number, **hint)))
    assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
    state = httpx.get(f"http://{HOST}:{prefill.bootstrap_port}/sim/rooms/{number}").json()
    assert state["dp_rank"] == wrong and state["state"] == "ready"


def test_decode_with_a_wrong_prefill_rank_gets_no_kv(dp_pair, room):
    prefill, decode = dp_pair
    number = room_of(room, 0)
    start = time.monotonic()
    [(p, d)] = pairs(prefill, decode, (body(prefill, number),
                                       body(prefill, number, disagg_prefill_dp_rank=1 - number % 2)))
    assert p.status_code == 500 and "KVPoll.Bootstrapping" in p.json()["message"]
    assert d.status_code == 500 and "KVPoll.WaitingForInput" in d.json()["message"]
    assert time.monotonic() - start < 5
    r = decode.post("/generate", json=body(prefill, room(), disagg_prefill_dp_rank=5))
    assert r.status_code == 500 and "Could not fetch bootstrap info for: prefill_dp_rank: 5" \
        in r.json()["message"]


def test_decode_asks_a_prefill_that_does_not_follow_rooms(sim_factory, room):
    """round_robin prefill under attention DP (where kv_mgr.attn_dp_rank is the rank): it
    registers each room's rank; the decode waits for that."""
    prefill = sim_factory("prefill", *PD_FLAGS, "--dp-size", "2", "--enable-dp-attention",
                          "--load-balance-method", "round_robin")
    decode = sim_factory("decode", *PD_FLAGS)
    first, _, third = room(), room(), room()
    numbers = [first, third]  # same parity: room % 2 would put both on one rank
    results = pairs(prefill, decode, body(prefill, numbers[0]))
    results += pairs(prefill, decode, body(prefill, numbers[1]))
    assert all(p.status_code == d.status_code == 200 for p, d in results)
    ranks = httpx.post(f"http://{HOST}:{prefill.bootstrap_port}/query_dp_ranks",
                       json={"bootstrap_rooms": numbers}).json()
    assert ranks == {str(numbers[0]): 0, str(numbers[1]): 1}
    # the decode arrives first: its join waits for the prefill's registration
    late = room()

    async def decode_first() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(timeout=20) as client:
            d = asyncio.create_task(client.post(decode.url + "/generate", json=body(prefill, late)))
            assert await asyncio.to_thread(
                wait_until, lambda: prefill.room_state(late) == "awaiting_rank")
            p = await client.post(prefill.url + "/generate", json=body(prefill, late))
            return p, await d
    p, d = asyncio.run(decode_first())
    assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)


def test_each_rank_has_its_own_prefix_cache(sim_factory):
    sim = sim_factory("null", "--dp-size", "2")
    ids = list(range(3000, 3040))

    def cached(rank: int) -> int:
        r = sim.post("/generate", json={"input_ids": ids, "routed_dp_rank": rank,
                                        "sampling_params": {"max_new_tokens": 1}})
        return r.json()["meta_info"]["cached_tokens"]
    assert cached(0) == 0
    assert cached(1) == 0  # rank 0 holds the prefix, rank 1 does not
    assert cached(0) == 39 and cached(1) == 39
    per_rank = sim.stats()["dp_ranks"]
    assert [r["requests"] for r in per_rank] == [2, 2]
    assert [r["cached_tokens"] for r in per_rank] == [39, 39]
    assert all(r["cache"]["size_tokens"] == 40 for r in per_rank)
    # round_robin (the default off a prefill) alternates
    for _ in range(2):
        sim.post("/generate", json={"text": "rr", "sampling_params": {"max_new_tokens": 1}})
    assert [r["dispatched"] for r in sim.stats()["dp_ranks"]] == [3, 3]


def test_openai_header_picks_the_rank(sim_factory):
    """X-Data-Parallel-Rank wins over the body's routed_dp_rank."""
    sim = sim_factory("null", "--dp-size", "2")
    r = sim.post("/v1/completions", json={"prompt": "hdr", "max_tokens": 1, "routed_dp_rank": 0},
                 headers={"X-Data-Parallel-Rank": "1"})
    assert r.status_code == 200
    assert [x["requests"] for x in sim.stats()["dp_ranks"]] == [0, 1]
    bad = sim.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]},
                   headers={"X-Data-Parallel-Rank": "one"})
    assert bad.status_code == 400 and bad.json()["message"] == (
        "Invalid X-Data-Parallel-Rank header: must be an integer, got 'one'")


def test_kv_events_per_rank_carry_their_rank(sim_factory):
    port = free_port_run(4)
    replay = port + 2  # ranks 0 and 1 of each: four ports in a row
    cfg = (f'{{"publisher":"zmq","endpoint":"tcp://*:{port}",'
           f'"replay_endpoint":"tcp://*:{replay}","topic":"kv"}}')
    sim = sim_factory("null", "--dp-size", "2", "--kv-events-config", cfg)
    info = sim.get("/server_info").json()["kv_events"]
    assert info["dp_size"] == 2 and info["endpoint_port_base"] == port
    assert info["replay_endpoint_port_base"] == replay
    for rank, ids in ((0, [11, 12, 13]), (1, [21, 22, 23, 24])):
        r = sim.post("/generate", json={"input_ids": ids, "routed_dp_rank": rank,
                                        "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 200
    for rank, ids in ((0, [11, 12, 13]), (1, [21, 22, 23, 24])):
        batches = _replay(replay + rank)
        assert [b[2] for b in batches] == [rank]  # [ts, events, attn_dp_rank]
        assert batches[0][1][0]["token_ids"] == ids
    for rank in (0, 1):  # the PUB sockets are bound at base + rank
        with socket.socket() as probe:
            assert probe.connect_ex((HOST, port + rank)) == 0


def _replay(port: int) -> list[list[Any]]:
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        out = []
        while dealer.poll(3000):
            frame = dealer.recv_multipart()
            if frame[2] == (-1).to_bytes(8, "big", signed=True):
                return out
            out.append(msgpack.unpackb(frame[3]))
        raise AssertionError("replay did not end")
    finally:
        dealer.close(linger=0)
        ctx.term()


def test_roomless_request_kills_a_follow_room_dp_prefill(sim_factory):
    """follow_bootstrap_room_scheduler asserts a room; the controller's exception ends the server."""
    prefill = sim_factory("prefill", "--dp-size", "2")
    with pytest.raises(httpx.HTTPError):
        prefill.post("/generate", json={"text": "no room"}, timeout=5)
    assert prefill.popen.wait(5) == CONTROLLER_CRASH_EXIT_CODE
