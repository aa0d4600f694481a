"""Client-supplied routing fields: what a body may not decide, and the rid it may.

PD pairing (bootstrap_*) and data-parallel placement belong to the gateway: a client value
could collide with another request's room or pin a rank that contradicts it, so such a body
is refused with 400 naming the field, before anything reaches a server. A client's `rid` is
validated and kept (it is SGLang's `meta_info.id`).
"""

from __future__ import annotations

import time

import orjson
import pytest

from gateway.request import DP_FIELDS, PD_FIELDS
from tests.security.honest import Honest

MARK = 987654321  # a value that must never reach a server


@pytest.mark.parametrize("field", PD_FIELDS + DP_FIELDS)
def test_routing_fields_are_refused_naming_the_field(keyed, sims, field):
    since = time.monotonic()
    with Honest(keyed, minimum=2):
        for path, body in (("/generate", {"text": "x"}),
                           ("/v1/completions", {"model": "sim-model", "prompt": "x"}),
                           ("/v1/chat/completions", {"model": "sim-model", "messages": [
                               {"role": "user", "content": "x"}]})):
            for value in (MARK, [MARK], str(MARK), 0):
                r = keyed.post(path, keyed.headers, json={**body, field: value})
                assert r.status_code == 400, (path, field, value, r.text)
                assert f"'{field}'" in r.json()["error"]["message"]
    assert not any(str(MARK).encode() in s.body for s in sims.seen(since=since))


@pytest.mark.parametrize("rid", ["a b", "x" * 129, "", "id\n", "ключ", 5, True, {"a": 1},
                                 ["one"], None])
def test_a_bad_rid_is_refused(keyed, rid):
    body = {"text": "x", "sampling_params": {"max_new_tokens": 1}, "rid": rid}
    if rid is None:
        body["rid"] = ["same", "same"]
        body["text"] = ["a", "b"]
    r = keyed.post("/generate", keyed.headers, json=body)
    assert r.status_code == 400, (rid, r.text)
    assert "'rid'" in r.json()["error"]["message"]


def test_a_good_rid_is_kept(keyed, sims):
    since = time.monotonic()
    r = keyed.post("/generate", keyed.headers,
                   json={"text": "x", "sampling_params": {"max_new_tokens": 1}, "rid": "my.rid:1"})
    assert r.status_code == 200 and r.json()["meta_info"]["id"] == "my.rid:1"
    bodies = [orjson.loads(s.body) for s in sims.seen("/generate", since)]
    # upstream it carries a random suffix (SGLang aborts by rid prefix), the same on both legs
    sent = [b["rid"] for b in bodies if str(b.get("rid")).startswith("my.rid:1-")]
    assert len(sent) == 2 and sent[0] == sent[1], bodies


def test_more_items_than_the_limit_are_refused(keyed):
    r = keyed.post("/generate", keyed.headers,
                   json={"text": ["x"] * 40, "sampling_params": {"max_new_tokens": 1, "n": 30}})
    assert r.status_code == 400 and "exceed the limit" in r.text
