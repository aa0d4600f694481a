"""Leg bodies are spliced from one shared part per request: both legs, every attempt and every
sample send the same bytes object for the client's fields (its own bytes when it can), with
only their own small head in front; joined, each is the JSON object the legs always got."""

import json

import pytest

from gateway.dispatch.leg_bodies import leg_bodies
from gateway.dispatch.parallel_samples import single_sample
from gateway.request import CHAT, GENERATE, parse_request
from gateway.upstream.base import Body
from tests.unit.builders import server

PREFILL = server("http://127.0.0.1:31000", "prefill")
PREFILL.bootstrap_port = 8998
DECODE = server("http://127.0.0.1:31001", "decode")


def unique_keys(pairs: list) -> dict:
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), f"a key twice: {keys}"
    return dict(pairs)


def joined(body: Body) -> dict:
    return json.loads(bytes(body), object_pairs_hook=unique_keys)


def test_both_legs_and_every_attempt_share_the_clients_own_bytes():
    raw = b'{ "messages": [{"role": "user", "content": "' + b"a" * 100_000 + b'"}] }'
    view = parse_request(CHAT, raw)
    first = leg_bodies(view, PREFILL, DECODE, 11, 0, True, "off")  # routed: legs differ
    retry = leg_bodies(view, PREFILL, DECODE, 12, None, False, "off")
    shared = first.payload.parts[1]
    assert shared.obj is raw  # the client's bytes themselves: nothing encoded again
    assert first.prefill_payload.parts[1] is shared and retry.payload.parts[1] is shared
    assert first.prefill_payload is not first.payload
    decode, prefill = joined(first.payload), joined(first.prefill_payload)
    assert decode["messages"][0]["content"] == "a" * 100_000
    assert decode["bootstrap_room"] == 11 and decode["disagg_prefill_dp_rank"] == 0
    assert "routed_dp_rank" not in decode and prefill["routed_dp_rank"] == 0
    assert joined(retry.payload)["bootstrap_room"] == 12
    assert decode["rid"] != joined(retry.payload)["rid"]  # a new rid per attempt
    assert len(first.payload) == len(bytes(first.payload))


@pytest.mark.parametrize("body, expected", [
    ({"text": "hi", "rid": "mine", "priority": 7}, {"priority": 7}),
    ({"text": "hi", "stream_options": {"include_usage": False}},
     {"stream_options": {"include_usage": False}}),
], ids=["client-rid-and-priority-kept", "client-stream-options"])
def test_a_body_with_fields_the_legs_set_is_encoded_once_without_them(body, expected):
    """The legs' fields are written once, in the leg's head: never twice in one object."""
    view = parse_request(GENERATE, json.dumps(body).encode())
    legs = leg_bodies(view, PREFILL, DECODE, 5, None, False, "off")
    again = leg_bodies(view, PREFILL, DECODE, 6, None, False, "off")
    assert legs.payload.parts[1] is again.payload.parts[1]
    sent = joined(legs.payload)
    assert sent["text"] == "hi" and sent["bootstrap_room"] == 5
    assert all(sent[k] == v for k, v in expected.items())
    if "rid" in body:
        assert sent["rid"].startswith("mine-") and legs.unsuffix


def test_the_samples_of_one_request_share_one_encoding():
    view = parse_request(CHAT, b'{"messages": [{"role": "user", "content": "q"}], "n": 3}')
    sample = single_sample(view)  # every sample task dispatches this one view
    bodies = [leg_bodies(sample, PREFILL, DECODE, room, None, False, "off").payload
              for room in (1, 2, 3)]
    assert bodies[0].parts[1] is bodies[1].parts[1] is bodies[2].parts[1]
    assert joined(bodies[0])["n"] == 1  # the sample's body, not the client's bytes


def test_a_gateway_field_named_twice_reaches_the_servers_once_as_the_gateway_read_it():
    """The client's bytes go as they are only when they name no field the gateway owns: a
    name given twice (`3`, then `null`, which the gateway reads and lets pass) would reach a
    server twice, and a server reading the first would pin a rank."""
    raw = b'{"text": "a", "data_parallel_rank": 3, "data_parallel_rank": null}'
    view = parse_request(GENERATE, raw)
    legs = leg_bodies(view, PREFILL, DECODE, 9, None, False, "off")
    assert legs.payload.parts[1].obj is not raw
    assert joined(legs.payload)["data_parallel_rank"] is None  # (unique_keys: named once)
