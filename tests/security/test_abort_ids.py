"""Two callers with the same client-chosen id in flight (`x-request-id`, or the body's `rid`):
each caller's abort stops its own stream only, and an admin's abort of the shared id stops
none (409, naming how many callers hold it) until `owner` says whose.

Until 2026-12 the first holder of an id hid every later one: bob's abort of his own `job-42`
was 404 while alice's ran, and the admin's abort of it (the id in bob's answer header)
stopped alice's stream and left bob's running.
"""

from __future__ import annotations

import os

import pytest

from tests.security.conftest import INFERENCE_KEY_A, INFERENCE_KEY_B, bearer
from tests.security.honest import Stream

A, B = bearer(INFERENCE_KEY_A), bearer(INFERENCE_KEY_B)
ABORT = "/abort_request"


def pair(gateway, how: str) -> tuple[str, Stream, Stream]:
    """Alice's stream, then bob's, both under one fresh id given as `how` says."""
    shared = f"job-{os.urandom(3).hex()}"
    ids = {"request_id": shared} if how == "header" else {"rid": shared}
    alice = Stream(gateway, A, tokens=400, **ids).begin()
    bob = Stream(gateway, B, tokens=400, **ids).begin()
    if how == "header":
        assert alice.request_id == bob.request_id == shared
    return shared, alice, bob


def aborted(stream: Stream) -> bool:
    stream.finish()
    reason = (stream.finish_reason or {}).get("type")
    error = stream.error_event or {}
    return reason == "abort" or error.get("type") == "request_aborted"


def check_ran_whole(stream: Stream) -> None:
    stream.finish()
    assert stream.completed, (stream.finish_reason, stream.error_event, stream.error)


@pytest.mark.parametrize("how", ["header", "rid"])
def test_each_owner_aborts_its_own_stream_under_a_shared_id(keyed, how):
    shared, alice, bob = pair(keyed, how)
    r = keyed.post(ABORT, B, json={"rid": shared})
    assert r.status_code == 200, r.text
    assert len(r.json()["request_ids"]) == 1
    assert aborted(bob), (bob.finish_reason, bob.error_event, bob.events[-1:])
    assert alice.is_alive(), "bob's abort stopped alice's stream"
    check_ran_whole(alice)


@pytest.mark.parametrize("how", ["header", "rid"])
def test_the_first_holder_aborts_its_own_and_leaves_the_later(keyed, how):
    shared, alice, bob = pair(keyed, how)
    r = keyed.post(ABORT, A, json={"rid": shared})
    assert r.status_code == 200, r.text
    assert aborted(alice), (alice.finish_reason, alice.error_event, alice.events[-1:])
    check_ran_whole(bob)


@pytest.mark.parametrize("how", ["header", "rid"])
def test_an_admin_abort_of_a_shared_id_stops_none_until_owner_names_one(keyed, how):
    shared, alice, bob = pair(keyed, how)
    admin = keyed.admin_headers
    r = keyed.post(ABORT, admin, json={"rid": shared})
    assert r.status_code == 409, r.text
    assert "2 callers" in r.text and "inference:0" in r.text and "inference:1" in r.text
    assert alice.is_alive() and bob.is_alive(), "a refused admin abort stopped a stream"
    r = keyed.post(ABORT, admin, json={"rid": shared, "owner": "inference:1"})
    assert r.status_code == 200, r.text
    assert aborted(bob), (bob.finish_reason, bob.error_event, bob.events[-1:])
    check_ran_whole(alice)


def test_an_admin_abort_of_an_id_one_caller_holds_twice_stops_both(keyed):
    shared = f"job-{os.urandom(3).hex()}"
    first = Stream(keyed, A, tokens=400, request_id=shared).begin()
    second = Stream(keyed, A, tokens=400, rid=shared).begin()
    other = Stream(keyed, B, tokens=400, request_id=f"job-{os.urandom(3).hex()}").begin()
    r = keyed.post(ABORT, keyed.admin_headers, json={"rid": shared})
    assert r.status_code == 200, r.text
    assert len(r.json()["request_ids"]) == 2
    assert aborted(first) and aborted(second)
    check_ran_whole(other)
