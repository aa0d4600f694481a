"""The soak's own parts, without processes: the schedule's rules and the invariant checker."""

from __future__ import annotations

import json
import random

import pytest

from tests.reliability.soak.runner import schedule_for
from tests.reliability.soak.schedule import KINDS, PREFILL_ONLY, _ends_first
from tests.reliability.soak.traffic import KINDS as REQUEST_KINDS
from tests.reliability.soak.traffic import Request, check, make_request

SEEDS = range(1, 41)


@pytest.mark.parametrize("seconds", [30.0, 600.0])
def test_a_healthy_server_of_each_role_always_remains(seconds):
    for seed in SEEDS:
        schedule = schedule_for(seed, seconds)
        for fault in schedule.faults:
            at = fault.start
            margin = {"kill": 8.0}  # a restarted server is busy while it starts
            busy = {f.server for f in schedule.faults
                    if f.start <= at < f.end + margin.get(f.kind, 0.0)}
            assert len({s for s in busy if s.startswith("prefill")}) <= 1, (seed, at)
            assert len({s for s in busy if s.startswith("decode")}) <= 2, (seed, at)


def test_a_server_carries_one_fault_at_a_time_and_every_fault_ends_in_time():
    for seed in SEEDS:
        schedule = schedule_for(seed, 60.0)
        for a in schedule.faults:
            assert a.end <= 60.0 - 3.0 and a.start < a.end
            assert not (a.kind in PREFILL_ONLY and not a.server.startswith("prefill"))
            for b in schedule.faults:
                if a is not b and a.server == b.server:
                    assert a.end <= b.start or b.end <= a.start, (seed, a, b)


def test_every_fault_is_undone_by_its_last_action():
    schedule = schedule_for(3, 120.0)
    ops = {a.op for a in schedule.actions}
    assert ops == {"knobs", "kill", "restart", "freeze", "thaw"}
    assert {f.kind for f in schedule.faults} == set(KINDS)
    for fault in schedule.faults:
        last = [a for a in schedule.actions if a.server == fault.server and a.at == fault.end]
        assert last, fault
        starting = [a for a in schedule.actions if a.at == fault.end
                    and a.server != fault.server and _ends_first(a)[1]]
        if starting:  # back to back: the end is played first
            assert schedule.actions.index(last[-1]) < schedule.actions.index(starting[0])
        assert last[-1].op in ("restart", "thaw") or all(
            not value for _, value in last[-1].knobs), (fault, last)


def _ask(kind: str) -> Request:
    rng = random.Random(0)
    while True:
        request = make_request(rng, 0)
        if request.kind == kind:
            return request


def _openai(request: Request, tokens: int, choices: int) -> bytes:
    return json.dumps({"choices": [{"index": i, "finish_reason": "length"}
                                   for i in range(choices)],
                       "usage": {"completion_tokens": tokens}}).encode()


def _stream(*events: object, done: int = 1) -> bytes:
    lines = [f"data: {json.dumps(e)}\n\n" for e in events] + ["data: [DONE]\n\n"] * done
    return "".join(lines).encode()


def test_every_request_kind_is_drawn():
    rng = random.Random(1)
    assert {make_request(rng, i).kind for i in range(200)} == set(REQUEST_KINDS)


def test_good_answers_pass():
    r = _ask("completion_n2")
    assert check(r, 200, _openai(r, 2 * r.tokens, 2)) is None
    g = _ask("generate")
    meta = {"completion_tokens": g.tokens, "finish_reason": {"type": "length"}}
    assert check(g, 200, json.dumps({"meta_info": meta}).encode()) is None
    s = _ask("chat_n2_stream")
    body = _stream({"choices": [{"index": 0, "finish_reason": "length"}]},
                   {"choices": [{"index": 1, "finish_reason": "length"}]},
                   {"choices": [], "usage": {"completion_tokens": 2 * s.tokens}})
    assert check(s, 200, body) is None


@pytest.mark.parametrize(("kind", "status", "body", "failure"), [
    ("chat", 502, b'{"error": {"message": "down"}}', "status_502"),
    ("chat", 200, b'{"choices": [{"index": 0, "finish', "malformed_json"),
    ("chat", 200, None, "token_count"),
    ("completion_n2", 200, "one choice", "choices"),
    ("chat_stream", 200, _stream({"choices": []}, done=2), "done_count"),
    ("chat_stream", 200, _stream({"choices": []}, done=0), "done_count"),
    ("chat_stream", 200, b'data: {"choi\n\ndata: [DONE]\n\n', "malformed_sse"),
    ("chat_stream", 200, _stream({"error": {"message": "decode failed"}}), "error_event"),
    ("generate_stream", 200, _stream({"meta_info": {"completion_tokens": 1,
                                                    "finish_reason": {"type": "abort"}}}),
     "token_count"),
], ids=["error-status", "cut-json", "short-count", "n2-one-choice", "two-done", "no-done",
        "cut-sse-line", "error-event", "native-stream-aborted"])
def test_broken_answers_fail_by_kind(kind, status, body, failure):
    request = _ask(kind)
    if body is None:
        body = _openai(request, request.tokens - 1, 1)
    elif body == "one choice":
        body = _openai(request, 2 * request.tokens, 1)
    assert check(request, status, body)[0] == failure
