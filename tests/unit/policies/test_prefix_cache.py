"""prefix_cache: exact matches from KV events, tree fallback when events are stale or useless."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from gateway.policies.base import build_options
from gateway.policies.prefix_cache import PrefixCacheOptions, PrefixCachePolicy, parse_tcp
from gateway.prefix.kv_index import block_hashes
from tests.unit.builders import chat, completion, generate_ids, generate_text, server

PROMPT = list(range(1000, 1064))  # 16 blocks of 4
A, B = "http://10.0.0.1:30000", "http://10.0.0.2:30000"


def policy(**options) -> PrefixCachePolicy:
    return PrefixCachePolicy("prefill", PrefixCacheOptions(**options))


def holds(p: PrefixCachePolicy, url: str, tokens: list[int], blocks: int | None = None) -> None:
    """Feed `p` an event batch saying `url` stored the leading blocks of `tokens`."""
    chain = list(block_hashes(tokens, 4))[:blocks]
    p.index.apply_batch((url, 0), [{"type": "BlockStored", "block_hashes": chain,
                                    "parent_block_hash": None, "token_ids": [],
                                    "block_size": 4, "lora_id": None}], time.monotonic())


def test_exact_state_beats_routing_history() -> None:
    """The tree says a (it was sent the prompt) but the events say only b still holds it."""
    p = policy()
    a, b = server(A), server(B)
    p.on_dispatch(a, generate_ids(PROMPT))
    holds(p, A, [])  # a's stream is alive, and its cache no longer has the prompt
    holds(p, B, PROMPT)
    assert p.pick([a, b], generate_ids(PROMPT + [1, 2])) is b
    assert p.stats()["matches"] == {"exact": 2, "approximate": 0}


def test_longest_exact_prefix_wins() -> None:
    p = policy()
    a, b = server(A), server(B)
    holds(p, A, PROMPT, blocks=6)
    holds(p, B, PROMPT, blocks=12)
    assert p.pick([a, b], generate_ids(PROMPT)) is b


@pytest.mark.parametrize(
    ("a_stream", "expected"),
    [
        pytest.param("fresh", "b", id="fresh_empty_cache_means_no_hit_least_loaded"),
        pytest.param("stale", "a", id="stale_stream_falls_back_to_tree"),
        pytest.param("never", "a", id="never_connected_falls_back_to_tree"),
    ],
)
def test_fallback_to_tree_for_stale_workers(a_stream: str, expected: str) -> None:
    p = policy(stale_after=30.0)
    a, b = server(A, in_flight=2), server(B)
    p.on_dispatch(a, generate_ids(PROMPT))  # the tree remembers a
    if a_stream != "never":
        holds(p, A, [])
    if a_stream == "stale":
        p.index._pending_since[A] = time.monotonic() - 100  # traffic, but silence since
    holds(p, B, [])
    assert p.pick([a, b], generate_ids(PROMPT)) is {"a": a, "b": b}[expected]


@pytest.mark.parametrize(
    ("view", "expected"),
    [
        pytest.param(chat(("user", "x" * 400)), "a", id="chat_text_uses_tree"),
        pytest.param(generate_ids(PROMPT, lora_path="adapter"), "a", id="lora_uses_tree"),
        pytest.param(generate_ids(PROMPT), "b", id="token_ids_use_events"),
    ],
)
def test_requests_events_cannot_describe_use_the_tree(view, expected) -> None:
    p = policy()
    a, b = server(A), server(B)
    p.on_dispatch(a, view)
    holds(p, A, [])
    holds(p, B, PROMPT)
    assert p.pick([a, b], view) is {"a": a, "b": b}[expected]


@pytest.mark.parametrize("text_view", [generate_text, completion,
                                       lambda text: chat(("user", text))],
                         ids=["generate", "completions", "chat"])
def test_text_matches_exactly_with_the_gateway_tokenizers_ids(text_view) -> None:
    p = policy()
    a, b = server(A), server(B)
    holds(p, A, [])
    holds(p, B, PROMPT)
    plain = text_view("hello")
    assert p.tokens_of(plain) is None  # no tokenizer loaded: the tree answers
    tokenized = dataclasses.replace(plain, routing_tokens=tuple(PROMPT))  # prompt_tokens.py
    assert p.pick([a, b], tokenized) is b


def test_load_guard_still_applies() -> None:
    p = policy()
    a, b = server(A, in_flight=80), server(B)
    holds(p, A, PROMPT)
    holds(p, B, [])
    assert p.pick([a, b], generate_ids(PROMPT)) is b


@pytest.mark.parametrize(
    ("options", "descriptor", "dp_size", "expected"),
    [
        pytest.param({}, None, 1, [("tcp://10.0.0.1:5557", None)], id="default_port_on_url_host"),
        pytest.param({"default_port": 0}, None, 1, [], id="no_port_no_subscription"),
        pytest.param({"endpoints": {A: "tcp://events-a:7000"}}, None, 2,
                     [("tcp://events-a:7000", None), ("tcp://events-a:7001", None)],
                     id="explicit_endpoint_and_dp_ranks"),
        pytest.param({"replay_port": 6000}, None, 1,
                     [("tcp://10.0.0.1:5557", "tcp://10.0.0.1:6000")], id="replay_port"),
        pytest.param({}, {"endpoint_port_base": 9100, "topic": "kv", "dp_size": 2,
                          "replay_endpoint_port_base": 9200, "block_size": 16}, 1,
                     [("tcp://10.0.0.1:9100", "tcp://10.0.0.1:9200"),
                      ("tcp://10.0.0.1:9101", "tcp://10.0.0.1:9201")],
                     id="server_info_descriptor"),
    ],
)
def test_event_sources(options, descriptor, dp_size, expected) -> None:
    p = policy(**options)
    w = server(A)
    w.dp_size = dp_size
    if descriptor is not None:
        w.kv_events = descriptor  # what the pool would record from /server_info
    sources = p._sources([w])
    assert [(s.endpoint, s.replay_endpoint) for s in sources] == expected
    assert [s.rank for s in sources] == list(range(len(expected)))
    if descriptor:
        assert sources[0].topic == "kv" and p.index.block_size(A) == 16


def test_ipv6_worker_host_is_bracketed() -> None:
    sources = policy()._sources([server("http://[fd00::5]:30000")])
    assert [s.endpoint for s in sources] == ["tcp://[fd00::5]:5557"]


def test_its_own_tokenizer_option_is_gone() -> None:
    """One tokenizer per gateway (gateway/tokens/prompt_tokens.py): the policy takes no path."""
    with pytest.raises(ValueError, match="unknown option 'tokenizer_path'"):
        build_options(PrefixCachePolicy, {"tokenizer_path": "/models/x/tokenizer.json"})


def test_workers_sharing_an_endpoint_are_not_followed() -> None:
    p = policy()
    same_host = [server("http://10.0.0.1:30000"), server("http://10.0.0.1:30001"), server(B)]
    assert [s.url for s in p._sources(same_host)] == [B]


def test_removed_worker_leaves_index_tree_and_subscriptions() -> None:
    p = policy()
    a, b = server(A), server(B)
    p.on_servers_changed([a, b])
    p.on_dispatch(a, generate_ids(PROMPT))
    holds(p, A, PROMPT)
    p.on_servers_changed([b])
    assert A not in p.index.servers() and A not in p.tree.server_sizes()
    assert [s.url for s in p.subscriber._wanted.values()] == [B]


def test_start_and_stop_without_sources() -> None:
    async def run() -> None:
        p = policy(default_port=0)
        p.on_servers_changed([server(A)])
        await p.start()
        await p.stop()

    asyncio.run(run())


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        pytest.param("tcp://host:5557", ("host", 5557), id="host_port"),
        pytest.param("tcp://[::1]:5557", ("[::1]", 5557), id="ipv6"),
        pytest.param("tcp://host", None, id="no_port"),
        pytest.param("ipc:///tmp/x", None, id="not_tcp"),
        pytest.param(5557, None, id="not_a_string"),
    ],
)
def test_parse_tcp(value, expected) -> None:
    assert parse_tcp(value) == expected


def test_candidates_not_announced_are_followed() -> None:
    p = policy()
    a, b = server(A), server(B)
    p.pick([a, b], generate_ids(PROMPT))
    assert sorted(s.url for s in p.subscriber._wanted.values()) == [A, B]


def test_each_dp_rank_matches_on_its_own_cache() -> None:
    from gateway.scheduling.scheduler import targets
    from gateway.servers.probe import ServerFacts

    p = policy()
    holder = server(A)
    holder.apply_facts(ServerFacts("prefill", 8998, "m", 4))
    ranks = targets([holder])
    p.on_servers_changed(ranks)
    chain = list(block_hashes(PROMPT, 4))
    p.index.apply_batch((A, 2), [{"type": "BlockStored", "block_hashes": chain,
                                  "parent_block_hash": None, "token_ids": [],
                                  "block_size": 4, "lora_id": None}], time.monotonic())
    for other in (0, 1, 3):  # events seen from every rank: all fresh
        p.index.apply_batch((A, other), [], time.monotonic())
    chosen = p.pick(ranks, generate_ids(PROMPT))
    assert (chosen.server, chosen.rank) == (holder, 2)
    exact = p.index.match(PROMPT, [(A, 0), (A, 2), A])
    assert exact == {(A, 0): 0, (A, 2): len(PROMPT), A: len(PROMPT)}
