"""GET /v1/responses/{id}/input_items as OpenAI lists them: every item typed and with an id
(a plain `{"role": "user", "content": "a"}` as a `message` with `input_text` parts), the
page per `order` (default desc), `limit` (default 20) and `after`, a bad value a JSON 400.
Until 2026-12-07 the items came as sent (the SDK read `type=None, id=None`) and the query
was ignored."""

from __future__ import annotations

import orjson
import pytest

from tests.unit.fakes import FakeCluster, FakeServer, run, served_client

P1, D1 = "http://127.0.0.1:30000", "http://127.0.0.1:30001"
INPUT = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
         {"role": "user", "content": [{"type": "input_text", "text": "c"}]}]


def _answer() -> bytes:
    return orjson.dumps({"id": "resp_x", "object": "response", "status": "completed",
                         "model": "m", "output": []})


def _pages(*queries: str) -> list:
    """The answers to `queries` of one kept turn's items (`{1}`: its second item's id)."""
    fake = FakeCluster({P1: FakeServer("prefill"),
                        D1: FakeServer("decode", chunks=[_answer()])})

    async def go():
        async with served_client(fake, "--max-attempts", "1") as c:
            await c.post("/v1/responses", json={"model": "m", "input": INPUT})
            rid = fake.servers[D1].received[0]["rid"].split("-", 1)[0]
            ids = [i["id"] for i in (await c.get(
                f"/v1/responses/{rid}/input_items?order=asc")).json().get("data", ())]
            return [await c.get(f"/v1/responses/{rid}/input_items{q.format(*ids)}")
                    for q in queries]

    return run(go())


def test_items_are_typed_messages_with_ids_newest_first_by_default():
    first, again = _pages("", "")
    body = first.json()
    assert first.status_code == 200 and body == again.json()  # ids the same on every read
    data = body["data"]
    assert [i["type"] for i in data] == ["message"] * 3
    assert [i["role"] for i in data] == ["user", "assistant", "user"]  # desc
    assert data[2]["content"] == [{"type": "input_text", "text": "a"}]
    assert data[1]["content"] == [{"type": "output_text", "text": "b"}]
    assert data[0]["content"] == INPUT[2]["content"]
    assert all(i["id"] and i["status"] == "completed" for i in data)
    assert len({i["id"] for i in data}) == 3
    assert (body["first_id"], body["last_id"], body["has_more"]) == (
        data[0]["id"], data[-1]["id"], False)


def test_order_limit_and_after_page_the_items():
    asc, first, after, rest = _pages("?order=asc", "?order=asc&limit=2",
                                     "?order=asc&limit=2&after={1}", "")
    every = asc.json()["data"]
    page = first.json()
    assert page["data"] == every[:2] and page["has_more"] is True
    assert page["last_id"] == every[1]["id"]
    assert after.json()["data"] == every[2:] and after.json()["has_more"] is False
    assert rest.json()["data"] == every[::-1]


@pytest.mark.parametrize("query", ["?limit=0", "?limit=101", "?limit=x", "?order=up",
                                   "?after=msg_nowhere"])
def test_a_bad_query_is_a_json_400(query):
    [r] = _pages(query)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
