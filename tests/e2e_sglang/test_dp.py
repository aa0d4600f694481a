"""DP ranks of a real SGLang 0.5.23 prefill (`--dp-size 2`, plain DP) behind the gateway.

Its own cluster (deploy/cpu-rig/topology-dp.yaml, launched by the gateway): one prefill with 2
DP ranks and one decode. On 0.5.23 a plain-DP prefill fails every request whose room does not
point at rank 0 unless the request names its rank (`disagg_prefill_dp_rank`; the
"follow_bootstrap_room conflict" of `CommonKVSender.__init__`, docs/FIDELITY.md). The gateway
treats each rank as a target, gives it rooms with `room % 2 == rank` and names the rank on both
legs; these tests show that every request then succeeds, that both ranks serve (counted by the
gateway and by the server itself), that parallel sampling and streaming work there, and that
a growing conversation stays on the rank that caches it.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e_sglang.conftest import (
    REPO,
    make_model,
    require_rig,
    sglang_processes,
    start_gateway,
)
from tests.procs import Proc

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]

TOPOLOGY = REPO / "deploy/cpu-rig/topology-dp.yaml"
MODEL = "tiny-llama"
RANKS = 2
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
         "november oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee "
         "zulu").split()


@dataclass(frozen=True)
class DpCluster:
    gateway: str
    prefill: str
    bootstrap_host: str
    bootstrap_port: int
    decode: str
    log_dir: Path
    gateway_proc: Proc


@pytest.fixture(scope="module")
def dp_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DpCluster]:
    require_rig()
    started = time.monotonic()
    model_path = make_model(tmp_path_factory.mktemp("tiny-model-dp"))
    base = os.environ.get("SGLANG_E2E_LOG_DIR")
    log_dir = Path(base) / "dp" if base else tmp_path_factory.mktemp("sglang-dp-logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    gateway, url = start_gateway(model_path, log_dir, TOPOLOGY,
                                 ("--prefill-policy", "cache_aware", "--loads-interval", "0.5"))
    print(f"\nDP cluster ready after {time.monotonic() - started:.1f}s (logs in {log_dir})")
    try:
        listed = httpx.get(url + "/admin/servers", timeout=30, trust_env=False).json()["servers"]
        prefill = next(s for s in listed if s["role"] == "prefill")
        decode = next(s for s in listed if s["role"] == "decode")
        yield DpCluster(url, prefill["url"], urlsplit(prefill["url"]).hostname,
                        prefill["bootstrap_port"], decode["url"], log_dir, gateway)
    finally:
        gateway.stop(grace=60)
        print(f"\nDP module: {time.monotonic() - started:.1f}s, start-up and stop included")
    left = sglang_processes(model_path)
    assert not left, f"SGLang processes left after the gateway stopped: {left}"


# -- helpers -------------------------------------------------------------------------------------

def post(url: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(url, json=body, timeout=timeout, trust_env=False)


def samples(url: str, name: str) -> dict[tuple, float]:
    """Prometheus samples named `name` at url/metrics, keyed by their sorted labels."""
    text = httpx.get(url + "/metrics", timeout=30, trust_env=False).text
    return {tuple(sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name}


def per_rank(values: dict[tuple, float], **match: str) -> dict[int, float]:
    out: dict[int, float] = {}
    for labels, value in values.items():
        labels = dict(labels)
        if all(labels.get(k) == v for k, v in match.items()):
            rank_label = labels.get("rank", labels.get("dp_rank"))
            out[int(rank_label)] = out.get(int(rank_label), 0.0) + value
    return out


class RankCounts:
    """Per-rank requests of the prefill between two moments, as the gateway counts them
    (`gateway_dp_rank_requests_total`, prefill legs steered to a rank) and as SGLang does
    (`sglang:kv_transfer_latency_ms_count{dp_rank}`: one per KV transfer, so health checks,
    which use a fake bootstrap host, are not counted)."""

    def __init__(self, cluster: DpCluster) -> None:
        self.cluster = cluster
        self.before = self._read()
        self.retries_before = self._retries()
        self.retried = 0  # attempts the gateway retried in between (set by `delta`)

    def _retries(self) -> int:
        """Attempts the gateway retried on another pair, all reasons (a slow attempt cut
        by its deadline on a loaded CPU rig is one: its prefill leg counts twice here)."""
        return int(sum(samples(self.cluster.gateway, "gateway_retries_total").values()))

    def _read(self) -> tuple[dict[int, float], dict[int, float]]:
        gateway = per_rank(samples(self.cluster.gateway, "gateway_dp_rank_requests_total"),
                           server=self.cluster.prefill)
        server = per_rank(samples(self.cluster.prefill, "sglang:kv_transfer_latency_ms_count"))
        return gateway, server

    def delta(self, expected: int, timeout: float = 10.0) -> tuple[list[int], list[int]]:
        """(gateway, server) per-rank counts since construction, once both sum to
        `expected` (the server's counters follow its transfers a little late)."""
        deadline = time.monotonic() + timeout
        while True:
            now = self._read()
            counts = tuple([int(after.get(r, 0) - before.get(r, 0)) for r in range(RANKS)]
                           for after, before in zip(now, self.before, strict=True))
            if all(sum(c) >= expected for c in counts) or time.monotonic() > deadline:
                self.retried = self._retries() - self.retries_before
                return counts


def policy_stats(url: str) -> dict:
    """The prefill policy's state (`GET /admin/policies`)."""
    return httpx.get(url + "/admin/policies", timeout=30, trust_env=False).json()["prefill"][
        "stats"]


def decisions(url: str) -> dict[str, int]:
    """The prefill policy's decisions so far, by reason (cache, spread, balance, ...)."""
    return dict(policy_stats(url)["decisions"])


def unrelated_prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(10))


# -- tests -----------------------------------------------------------------------------------------

def test_gateway_sees_the_prefill_ranks(dp_cluster: DpCluster) -> None:
    info = httpx.get(dp_cluster.prefill + "/server_info", timeout=30, trust_env=False).json()
    assert (info["dp_size"], info["attn_dp_size"]) == (RANKS, 1)
    assert info["load_balance_method"] == "follow_bootstrap_room"
    assert len(info["internal_states"]) == RANKS
    loads = httpx.get(dp_cluster.prefill + "/v1/loads", timeout=30, trust_env=False).json()
    assert sorted(entry["dp_rank"] for entry in loads["loads"]) == list(range(RANKS))
    listed = httpx.get(dp_cluster.gateway + "/admin/servers", timeout=30,
                       trust_env=False).json()["servers"]
    by_role = {s["role"]: s for s in listed}
    prefill, decode = by_role["prefill"], by_role["decode"]
    assert prefill["dp_ranks"] == RANKS
    assert prefill["load_balance_method"] == "follow_bootstrap_room"
    assert [r["rank"] for r in prefill["ranks"]] == list(range(RANKS))
    assert decode["dp_ranks"] == 1 and decode["ranks"] == []


def test_without_the_rank_hint_sglang_fails_rooms_off_rank_0(dp_cluster: DpCluster) -> None:
    """The bug the gateway works around, shown directly on the servers: an odd room on the
    dp-2 prefill without `disagg_prefill_dp_rank` is a 500 "follow_bootstrap_room conflict"
    (and its decode waits for KV that never comes: closed here after 10 s); the same
    request naming rank 1 on both legs succeeds."""
    base = {"text": "hello world", "sampling_params": {"max_new_tokens": 4, "temperature": 0},
            "bootstrap_host": dp_cluster.bootstrap_host,
            "bootstrap_port": dp_cluster.bootstrap_port}

    async def legs(body: dict) -> dict[str, tuple[int, str] | None]:
        results: dict[str, tuple[int, str] | None] = {"prefill": None, "decode": None}
        async with httpx.AsyncClient(timeout=None, trust_env=False) as client:
            async def leg(name: str, url: str) -> None:
                response = await client.post(url + "/generate", json=body)
                results[name] = (response.status_code, response.text)

            tasks = [asyncio.create_task(leg("prefill", dp_cluster.prefill)),
                     asyncio.create_task(leg("decode", dp_cluster.decode))]
            await asyncio.wait(tasks, timeout=10)
            for task in tasks:
                task.cancel()  # closing the connection aborts the request in SGLang
            await asyncio.gather(*tasks, return_exceptions=True)
        return results

    odd_room = secrets.randbits(62) * 2 + 1
    plain = asyncio.run(legs({**base, "bootstrap_room": odd_room}))
    print("odd room, no rank hint:", {k: v and (v[0], v[1][:300]) for k, v in plain.items()})
    assert plain["prefill"] is not None and plain["prefill"][0] == 500, plain
    assert "follow_bootstrap_room conflict" in plain["prefill"][1]
    assert plain["decode"] is None or plain["decode"][0] != 200

    hinted = asyncio.run(legs({**base, "bootstrap_room": odd_room + 2,
                               "disagg_prefill_dp_rank": 1}))
    assert [hinted[leg] and hinted[leg][0] for leg in ("prefill", "decode")] == [200, 200], hinted
    assert json.loads(hinted["prefill"][1])["meta_info"]["dp_rank"] == 1


def test_unrelated_prompts_all_succeed_on_both_ranks(dp_cluster: DpCluster) -> None:
    """40 requests with unrelated prompts, 4 at a time: every one 200 (half would fail
    without the steering, see above), and each rank serves at least 15% of them."""
    rng = random.Random(20261201)
    bodies = [{"text": unrelated_prompt(rng), "sampling_params": {"max_new_tokens": 8}}
              for _ in range(40)]
    counts = RankCounts(dp_cluster)

    async def run() -> list[httpx.Response]:
        limit = asyncio.Semaphore(4)
        async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
            async def one(body: dict) -> httpx.Response:
                async with limit:
                    return await client.post(dp_cluster.gateway + "/generate", json=body)

            return await asyncio.gather(*(one(body) for body in bodies))

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * len(bodies), \
        [r.text for r in responses if r.status_code != 200][:3]
    gateway, server = counts.delta(len(bodies))
    retried = counts.retried
    print(f"per-rank requests of 40: gateway {gateway}, server {server}, retried {retried}")
    # every prefill leg the gateway steered, retries included (CI once saw 3 on a loaded
    # rig: 43 legs, 42 transfers, as an abandoned attempt may or may not finish its transfer)
    assert sum(gateway) == len(bodies) + retried, (gateway, server, retried)
    assert len(bodies) <= sum(server) <= sum(gateway), (gateway, server, retried)
    # the server ran each request on the rank the gateway chose
    assert all(abs(g - s) <= retried for g, s in zip(gateway, server, strict=True)), \
        (gateway, server, retried)
    assert min(server) >= 0.15 * len(bodies), server


def test_parallel_sampling_on_the_dp_prefill(dp_cluster: DpCluster) -> None:
    """n=2 (native, whole; chat, streamed): well formed, the greedy samples equal the n=1
    answer, and both samples' prefill legs ran on one rank (they follow sample 0 to its
    cached prompt)."""
    text = "the dp prefill samples twice " + unrelated_prompt(random.Random(2))
    params = {"max_new_tokens": 8, "temperature": 0}
    single = post(dp_cluster.gateway + "/generate", {"text": text, "sampling_params": params})
    assert single.status_code == 200, single.text
    counts = RankCounts(dp_cluster)
    got = post(dp_cluster.gateway + "/generate",
               {"text": text, "sampling_params": {**params, "n": 2}})
    assert got.status_code == 200, got.text
    items = got.json()
    assert isinstance(items, list) and len(items) == 2
    assert [item["output_ids"] for item in items] == [single.json()["output_ids"]] * 2
    gateway, server = counts.delta(2)
    assert sorted(gateway) == [0, 2] and server == gateway, (gateway, server)

    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "n": 2,
            "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    streamed = post(dp_cluster.gateway + "/v1/chat/completions", body)
    assert streamed.status_code == 200, streamed.text
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    contents = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk["choices"]:
            contents[choice["index"]] += choice["delta"].get("content") or ""
    assert contents[0] == contents[1]
    usage = [c["usage"] for c in chunks if not c["choices"]]
    assert len(usage) == 1 and usage[0]["completion_tokens"] <= 16


def test_streams_succeed_on_both_ranks(dp_cluster: DpCluster) -> None:
    rng = random.Random(7)
    bodies = [{"text": unrelated_prompt(rng), "stream": True,
               "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}} for _ in range(12)]
    counts = RankCounts(dp_cluster)

    async def run() -> list[httpx.Response]:
        limit = asyncio.Semaphore(2)
        async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
            async def one(body: dict) -> httpx.Response:
                async with limit:
                    return await client.post(dp_cluster.gateway + "/generate", json=body)

            return await asyncio.gather(*(one(body) for body in bodies))

    for answer in asyncio.run(run()):
        assert answer.status_code == 200, answer.text
        events = [line[6:] for line in answer.text.splitlines() if line.startswith("data: ")]
        assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
        assert len(json.loads(events[-2])["output_ids"]) == 8
    gateway, server = counts.delta(len(bodies))
    print(f"per-rank streams of {len(bodies)}: gateway {gateway}, server {server}")
    assert gateway == server and min(gateway) >= 1, (gateway, server)


@pytest.mark.parametrize("endpoint", ["generate", "chat"])
def test_a_growing_conversation_stays_on_its_rank(dp_cluster: DpCluster, endpoint: str) -> None:
    """Multi-turn: each turn's prompt extends the previous one, so cache_aware sends every
    turn to the rank that holds the conversation; there SGLang finds the previous prompt in
    its radix cache: `meta_info.cached_tokens`, and for chat `usage.prompt_tokens_details`
    (the topology sets --enable-cache-report); the gateway counts the prefill's figure in
    `gateway_cached_tokens_total` per server."""
    turns = 5
    rng = random.Random(endpoint)
    counts = RankCounts(dp_cluster)
    cached_before = samples(dp_cluster.gateway, "gateway_cached_tokens_total")
    text = f"system: {unrelated_prompt(rng)}\n"
    messages = [{"role": "system", "content": unrelated_prompt(rng)}]
    prompts, cached, why = [], [], []
    for turn in range(turns):
        before = decisions(dp_cluster.gateway)
        question = f"question {turn}: {unrelated_prompt(rng)}"
        if endpoint == "generate":
            text += f"user: {question}\nassistant:"
            answer = post(dp_cluster.gateway + "/generate",
                          {"text": text, "sampling_params": {"max_new_tokens": 8}})
            assert answer.status_code == 200, answer.text
            meta = answer.json()["meta_info"]
            text += answer.json()["text"] + "\n"
            prompts.append(meta["prompt_tokens"])
            cached.append(meta["cached_tokens"])
        else:
            messages.append({"role": "user", "content": question})
            answer = post(dp_cluster.gateway + "/v1/chat/completions",
                          {"model": MODEL, "messages": messages, "max_tokens": 8})
            assert answer.status_code == 200, answer.text
            out = answer.json()
            messages.append({"role": "assistant",
                             "content": out["choices"][0]["message"]["content"]})
            prompts.append(out["usage"]["prompt_tokens"])
            details = out["usage"].get("prompt_tokens_details") or {}
            cached.append(details.get("cached_tokens"))
        after = decisions(dp_cluster.gateway)
        why.append({k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k)})
    gateway, server = counts.delta(turns)
    print(f"{endpoint}: per-rank turns gateway {gateway} server {server}; "
          f"prompt tokens {prompts}; cached tokens in answers {cached}; decisions {why}")
    # Every later turn follows the cache, unless the rank holding it looked busier than
    # computing the prompt again elsewhere ("spread"/"balance": a health check's one-token
    # request, SGLang's /health generates, sits in a rank's queue on this slow rig): the
    # conversation then moves once and follows its cache on the new rank.
    moves = [turn for turn in range(1, turns) if set(why[turn]) != {"cache"}]
    last_move = policy_stats(dp_cluster.gateway)["last_move"]
    assert all(set(why[turn]) <= {"spread", "balance"} for turn in moves), (why, last_move)
    assert len(moves) <= 1, (why, last_move)
    stays = [turns] if not moves else [moves[0], turns - moves[0]]
    assert sorted(gateway) == [0] * (2 - len(stays)) + sorted(stays) and server == gateway, (
        gateway, server, why, last_move)
    if moves:  # the rank holding the conversation (the longest match) looked busy; another
        # rank may match a token or two of any prompt, from earlier tests, and be idle
        holder = max(last_move["targets"], key=lambda target: target["matched"])
        assert holder["load"] > 0, last_move
    found = [turn for turn in range(1, turns) if turn not in moves]
    for turn in found:  # the previous turn's prompt was found in the cache
        assert cached[turn] >= 0.9 * prompts[turn - 1], (prompts, cached)
    expected = 0.9 * sum(prompts[turn - 1] for turn in found)
    deadline = time.monotonic() + 10
    while True:  # the gateway counts the prefill's own answers, which may come a bit later
        after = samples(dp_cluster.gateway, "gateway_cached_tokens_total")
        key = (("server", dp_cluster.prefill),)
        hit = after.get(key, 0.0) - cached_before.get(key, 0.0)
        if hit >= expected or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    print(f"{endpoint}: gateway_cached_tokens_total grew by {hit:g}")
    assert hit >= expected, (hit, prompts)
