"""Expanding previous_response_id into the whole input (as SGLang's own history), and the
routing key of the expanded conversation growing by prefix."""

from __future__ import annotations

import orjson
import pytest

from gateway.errors import BadRequest
from gateway.request import RESPONSES
from gateway.responses import history
from gateway.responses.view import parse_responses

ANSWER = {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
          "content": [{"type": "output_text", "text": "Hi!", "annotations": []}]}


def stored(items, status="completed"):
    return history.parse_record(history.record_of(
        {"id": "resp_1", "status": status, "output": [ANSWER]}, items))


def test_a_first_turn_is_its_input_and_asks_no_server_to_keep_it():
    body = {"model": "m", "input": "Hello", "store": True, "instructions": "Be kind."}
    new = history.expand(body, None, "resp_new")
    assert new["input"] == [{"role": "user", "content": "Hello"}]
    assert new["store"] is False and new["rid"] == "resp_new"
    assert new["instructions"] == "Be kind."


def test_a_next_turn_is_the_history_its_output_then_the_new_input():
    previous = stored([{"role": "user", "content": "Hello"}])
    body = {"model": "m", "input": [{"role": "user", "content": "More"}],
            "previous_response_id": "resp_1"}
    new = history.expand(body, previous, "resp_2")
    assert new["input"] == [{"role": "user", "content": "Hello"}, ANSWER,
                            {"role": "user", "content": "More"}]
    assert "previous_response_id" not in new and "instructions" not in new


@pytest.mark.parametrize("status", ["in_progress", "failed", "cancelled"])
def test_only_a_finished_response_is_continued(status):
    with pytest.raises(BadRequest):
        history.expand({"input": "x"}, stored([], status), "resp_2")


def test_each_turn_routes_by_a_key_that_extends_the_last():
    body = {"model": "m", "input": "Hello", "instructions": "Be kind."}
    first = history.expand(body, None, "resp_1")
    record = stored(first["input"])
    second = history.expand({"model": "m", "input": "More", "instructions": "Be kind."},
                            record, "resp_2")
    one = parse_responses(RESPONSES, orjson.dumps(first)).routing_text
    two = parse_responses(RESPONSES, orjson.dumps(second)).routing_text
    assert two.startswith(one) and len(two) > len(one)
    assert "Hi!" in two[len(one):]


@pytest.mark.parametrize("field", ["bootstrap_room", "routed_dp_rank", "bootstrap_host"])
def test_fields_the_gateway_sets_are_refused(field):
    with pytest.raises(BadRequest, match=field):
        parse_responses(RESPONSES, orjson.dumps({"input": "x", field: 1}))
