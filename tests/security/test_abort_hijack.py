"""Abort hijack: a caller aborts only its own requests, and the servers are asked to abort
exactly that request's rid, never a prefix that SGLang would match against others.

Client A (inference key A) streams; client B (key B) tries every id of A's it could learn or
guess. The wire taps show what reached the servers' `/abort_request`; the simulators' room
lists show how each request ended there.
"""

from __future__ import annotations

import os
import time

import orjson
import pytest

from tests.security.conftest import INFERENCE_KEY_A, INFERENCE_KEY_B, bearer
from tests.security.honest import Honest, Stream
from tests.security.rig import wait_for

A, B = bearer(INFERENCE_KEY_A), bearer(INFERENCE_KEY_B)
ABORT = "/abort_request"


def abort_posts(sims, since: float) -> list[dict]:
    return [orjson.loads(s.body) for s in sims.seen(ABORT, since)]


def hijack_attempts(victim: Stream) -> list[dict]:
    xid, rid = victim.request_id, victim.meta_id
    return [
        {"rid": xid}, {"rid": rid}, {"rid": rid[:8]}, {"rid": rid[:1]}, {"rid": xid[:6]},
        {"rid": xid, "abort_all": "true"}, {"rid": rid, "abort_all": 1},
        {"rid": rid, "owner": "inference:0", "admin": True}, {"rid": rid + "\n"},
        {"rid": rid.upper()}, {"rid": [rid]}, {"rid": {"startswith": rid[:4]}},
        {"abort_all": True}, {"abort_all": True, "rid": ""}, {"abort_all": "true"}, {},
    ]


def attack(gateway, victim: Stream, headers) -> list[int]:
    statuses = []
    for body in hijack_attempts(victim):
        r = gateway.post(ABORT, headers, json=body)
        statuses.append(r.status_code)
        assert r.status_code in (400, 401, 403, 404), (body, r.status_code, r.text)
    return statuses


def check_hijack_fails(gateway, sims, attackers=(B,), victim_headers=A) -> None:
    """Each attacker tries every id of its own victim stream of A's (all at once); every
    victim runs to its end and no abort reached a server."""
    since = time.monotonic()
    victims = [Stream(gateway, victim_headers, tokens=150,
                      request_id=f"victim-{os.urandom(4).hex()}") for _ in attackers]
    for victim in victims:
        victim.start()
    for victim, attacker in zip(victims, attackers, strict=True):
        victim.begin()
        statuses = attack(gateway, victim, attacker)
        if attacker is None:
            assert set(statuses) == {401}
        else:
            assert {403, 404} <= set(statuses), statuses
    for victim in victims:
        victim.finish()
        assert victim.completed, (victim.finish_reason, victim.error_event, victim.error)
        assert [r["outcome"] for r in sims.decode.rooms(victim.meta_id)] == ["completed"]
    assert abort_posts(sims, since) == [], "a refused abort reached a server"


def test_another_key_cannot_abort_a_stream(keyed, sims):
    with Honest(keyed):
        check_hijack_fails(keyed, sims, (B, {"x-api-key": INFERENCE_KEY_B}, None))


def check_own_abort(gateway, sims, by: str, headers=A) -> None:
    since = time.monotonic()
    own = Stream(gateway, A, tokens=400, request_id=f"own-{os.urandom(4).hex()}").begin()
    rid = own.meta_id
    key = {"request_id": own.request_id, "meta_id": rid}[by]
    r = gateway.post(ABORT, headers, json={"rid": key})
    assert r.status_code == 200, r.text
    assert r.json()["request_id"] == own.request_id
    own.finish()
    assert own.done and own.finish_reason["type"] == "abort", own.events[-1:]
    assert len(own.events) < 300, "the stream was not cut short"
    posts = abort_posts(sims, since)
    assert posts and all(p == {"rid": rid} for p in posts), posts
    assert {s.path for s in sims.prefill.tap.seen(ABORT, since)} == {ABORT}
    assert {s.path for s in sims.decode.tap.seen(ABORT, since)} == {ABORT}
    wait_for(lambda: [x["outcome"] for x in sims.decode.rooms(rid)] == ["aborted"], 10,
             "the decode ended the request as aborted")


@pytest.mark.parametrize("by", ["request_id", "meta_id"])
def test_a_caller_aborts_its_own_stream_by_its_exact_ids(keyed, sims, by):
    with Honest(keyed):
        check_own_abort(keyed, sims, by)


def test_an_admin_aborts_any_stream(keyed, sims):
    with Honest(keyed):
        check_own_abort(keyed, sims, "request_id", headers=keyed.admin_headers)


def test_a_short_client_rid_is_never_forwarded_as_a_prefix(keyed, sims):
    """SGLang's scheduler aborts every rid that STARTS WITH the one it is given: D's own rid "a"
    goes upstream with a random suffix, so aborting it can only ever reach D's request."""
    since = time.monotonic()
    with Honest(keyed):
        victim = Stream(keyed, B, tokens=150, rid=f"abc-{os.urandom(4).hex()}").begin()
        short = Stream(keyed, A, tokens=400, rid="a").begin()
        r = keyed.post(ABORT, A, json={"rid": "a"})
        assert r.status_code == 200, r.text
        short.finish()
        assert short.done and (short.finish_reason or {}).get("type") == "abort", short.events[-1:]
        own = Stream(keyed, A, tokens=400, rid=f"zz-{os.urandom(4).hex()}").begin()
        assert keyed.post(ABORT, A, json={"rid": own.meta_id}).status_code == 200
        own.finish()
        victim.finish()
    assert victim.completed, (victim.finish_reason, victim.error_event)
    posts = {p["rid"] for p in abort_posts(sims, since)}
    assert "a" not in posts and own.meta_id not in posts, posts  # never a bare client rid
    assert any(p.startswith("a-") for p in posts) and any(p.startswith(own.meta_id + "-")
                                                            for p in posts), posts
    upstream = {orjson.loads(s.body).get("rid") for s in sims.seen("/generate", since)}
    assert all(not other.startswith(p) for p in posts for other in upstream - {p}), posts


def test_no_client_rid_reaches_a_server_as_a_prefix_of_another_rid(keyed, sims):
    since = time.monotonic()
    victim = Stream(keyed, B, tokens=100, rid=f"abc-{os.urandom(4).hex()}").begin()
    short = Stream(keyed, A, tokens=5, rid="a")
    short.start()
    short.finish()
    victim.finish()
    upstream = [orjson.loads(s.body).get("rid") for s in sims.seen("/generate", since)]
    assert "a" not in upstream, "rid 'a' reached the servers while 'abc-...' ran"
    sent = [rid for rid in upstream if isinstance(rid, str) and rid.startswith("a-")]
    assert sent and all(not other.startswith(rid) for rid in sent for other in upstream
                        if other != rid), upstream  # unique: a prefix of nothing else
    assert short.meta_id == "a", short.meta_id  # the client still reads its own rid
