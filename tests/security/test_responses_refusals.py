"""A Responses request refused before dispatch writes nothing to the store, and no Responses
failure is plain text.

Until 2026-12-07 `POST /v1/responses` wrote its in_progress record (the whole input) before the
inference endpoint charged the key's rate: with `--rate-limit 1 --rate-burst 2`, 60 requests
were 5 served and 55 refused (429), and the store grew by 60 records, so one key could fill the
store's global byte limit and evict every tenant's records without being served. A body nested
255-1024 levels (valid JSON orjson reads but cannot write) was a plain-text 500 with a
traceback. Now the record is written when the servers are asked, and the nesting is a 400.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator

import orjson
import pytest

from gateway.responses.turns import KEPT_DEPTH
from tests.security.conftest import INFERENCE_KEY_A, INFERENCE_KEY_B, bearer
from tests.security.rig import Gateway, start_gateway

MODEL = "sim-model"


def keeping(logs, sims, key_file, name: str, *args: str) -> Gateway:
    """A keyed gateway keeping responses in its own SQLite file."""
    store = logs / f"{name}.sqlite3"
    gateway = start_gateway(logs, name, sims, ["--api-key-file", str(key_file),
                                               "--responses-store", str(store), *args])
    gateway.store = store
    return gateway


@pytest.fixture(scope="module")
def kept(logs, sims, key_file) -> Iterator[Gateway]:
    gateway = keeping(logs, sims, key_file, "responses-kept")
    yield gateway
    gateway.stop()


@pytest.fixture(scope="module")
def limited(logs, sims, key_file) -> Iterator[Gateway]:
    """Keys limited to 1 request/s (burst 2): every request charges, GET included."""
    gateway = keeping(logs, sims, key_file, "responses-limited", "--rate-limit", "1",
                      "--rate-burst", "2")
    yield gateway
    gateway.stop()


def records(gateway: Gateway) -> dict[str, str]:
    """Every record's id and status, read from the store's file."""
    with sqlite3.connect(gateway.store) as db:
        rows = db.execute("SELECT id, record FROM responses WHERE id != ?",
                          ("resp_corrupt",)).fetchall()
    return {rid: orjson.loads(record)["status"] for rid, record in rows}


def nested(depth: int) -> bytes:
    """A body `depth` levels deep: its metadata holds the nesting."""
    inner = depth - 2  # the body's object, then its metadata object
    return (b'{"model":"' + MODEL.encode() + b'","input":"hi","max_output_tokens":2,'
            b'"metadata":{"a":' + b"[" * inner + b"]" * inner + b"}}")


def post(gateway: Gateway, key: str, content: bytes):
    return gateway.post("/v1/responses", {**bearer(key), "content-type": "application/json"},
                        content=content)


@pytest.mark.parametrize("depth", [KEPT_DEPTH + 1, 300, 1000])
def test_a_body_nested_too_deeply_is_a_json_400_and_stores_nothing(kept, depth):
    before = records(kept)
    r = post(kept, INFERENCE_KEY_A, nested(depth))
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]  # before: text/plain "Internal Server Error"
    assert error["type"] == "invalid_request_error"
    assert "nested too deeply" in error["message"] and str(KEPT_DEPTH) in error["message"]
    assert records(kept) == before


def test_the_deepest_body_kept_is_served_and_kept(kept):
    r = post(kept, INFERENCE_KEY_B, nested(KEPT_DEPTH))
    assert r.status_code == 200, r.text[:300]
    got = kept.get(f"/v1/responses/{r.json()['id']}", bearer(INFERENCE_KEY_B))
    assert got.status_code == 200 and got.json()["status"] in ("completed", "incomplete")


def test_a_rate_limited_key_stores_only_what_it_was_served(limited):
    before = records(limited)
    body = orjson.dumps({"model": MODEL, "input": "flood " + "x" * 2000,
                         "max_output_tokens": 1})
    answers = [post(limited, INFERENCE_KEY_A, body) for _ in range(12)]
    served = {a.json()["id"]: a.json()["status"] for a in answers if a.status_code == 200}
    refused = [a for a in answers if a.status_code == 429]
    assert len(served) + len(refused) == 12 and len(refused) >= 8, \
        [a.status_code for a in answers]
    assert refused[0].json()["error"]["type"] == "rate_limit_error"
    after = records(limited)  # before: one (failed) record per request
    assert {rid: after[rid] for rid in set(after) - set(before)} == served


def test_refusals_before_dispatch_store_nothing(kept):
    before = records(kept)
    for refused in ({"stream": "yes"}, {"bootstrap_room": 7}, {"model": 3}):  # the parse's
        body = orjson.dumps({"model": MODEL, "input": "hi", **refused})
        assert post(kept, INFERENCE_KEY_B, body).status_code == 400, refused
    assert post(kept, "sk-wrong", orjson.dumps({"model": MODEL, "input": "hi"})
                ).status_code == 401
    assert records(kept) == before


def test_a_corrupt_record_is_a_json_500_not_plain_text(kept):
    """A previous response whose record is not JSON (a store damaged by hand): before, the
    exception left ResponsesEndpoint and the client got text/plain "Internal Server Error"."""
    with sqlite3.connect(kept.store) as db:
        db.execute("INSERT INTO responses (tenant, id, written, size, record) "
                   "VALUES ('default', 'resp_corrupt', 1e12, 8, X'6e6f74206a736f6e')")
    r = post(kept, INFERENCE_KEY_B, orjson.dumps(
        {"model": MODEL, "input": "hi", "previous_response_id": "resp_corrupt"}))
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    assert r.json()["error"]["message"] == "internal gateway error; see the gateway log"
    assert "Traceback" not in r.text
