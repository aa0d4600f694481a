"""`/generate` with `input_embeds`: a shape SGLang 0.5.23 refuses is refused here (400, no leg),
and the shapes it takes pass with its batch size.

SGLang's rules: `GenerateReqInput.input_embeds` is `List[List[List[float]]] | List[List[float]]`
(managers/io_struct.py), parsed by FastAPI's pydantic with lax floats (numbers, booleans,
numeric strings), 400 otherwise; `_determine_batch_size` reads `input_embeds[0][0]` when the
embeddings are the prompt (an empty list or first row: an IndexError, a 500); and
`_validate_inputs` refuses text, input_ids and input_embeds all at once. Before, any non-empty
list went to both legs and the decode's 400 (or 500) came back.
"""

from __future__ import annotations

import orjson
import pytest

from gateway.errors import BadRequest
from gateway.request import GENERATE, parse_request
from tests.unit.fakes import FakeCluster, FakeServer, run
from tests.unit.fakes import served_client as gateway

P1, D1 = "http://127.0.0.1:30000", "http://127.0.0.1:30001"


def view(body: dict):
    return parse_request(GENERATE, orjson.dumps(body))


@pytest.mark.parametrize("embeds, batch, tokens", [
    ([[0.1, 0.2], [0.3, 0.4]], None, 2),
    ([[1, 2], [3, 4]], None, 2),  # ints are floats to pydantic
    ([[True, "0.5", " 1e3 ", "nan"]], None, 1),  # lax floats: booleans, numeric strings
    ([[0.5], []], None, 2),  # a later row may be empty: only the first is read
    ([[[0.1], [0.2]], [[0.3]]], 2, 3),
    ([[[0.1]], []], 2, 1),  # likewise a later prompt
], ids=["2d", "2d-ints", "2d-lax", "2d-later-row-empty", "3d", "3d-later-prompt-empty"])
def test_shapes_sglang_takes_pass(embeds, batch, tokens):
    v = view({"input_embeds": embeds})
    assert (v.batch_size, v.prompt_tokens) == (batch, tokens)


REFUSED = {
    "4d": [[[[0.1]]]],
    "1d": [0.1, 0.2],
    "not-a-list": "0.1",
    "null-in-a-row": [[0.1, None]],
    "not-numeric-text": [[0.1, "x"]],
    "non-ascii-digits": [["١"]],  # Python's float() reads it, pydantic does not
    "object-in-a-row": [[{"x": 1}]],
    "mixed-depths": [[0.1], [[0.2]]],
    "empty": [],
    "empty-first-row": [[], [0.1]],
    "empty-first-prompt": [[], [[0.1]]],
}


@pytest.mark.parametrize("embeds", list(REFUSED.values()), ids=list(REFUSED))
def test_shapes_sglang_refuses_are_refused(embeds):
    with pytest.raises(BadRequest) as caught:
        view({"input_embeds": embeds})
    assert caught.value.status == 400 and "input_embeds" in caught.value.message


def test_a_bad_shape_beside_a_text_is_refused_too():
    """SGLang parses `input_embeds` even when `text` is the prompt (then it drops it)."""
    with pytest.raises(BadRequest):
        view({"text": "hi", "input_embeds": [[[[0.1]]]]})
    assert view({"text": "hi", "input_embeds": []}).routing_text == "hi"  # not read: passes


def test_text_input_ids_and_input_embeds_together_are_refused():
    with pytest.raises(BadRequest):
        view({"text": "hi", "input_ids": [1], "input_embeds": [[0.1]]})


@pytest.mark.parametrize("embeds", [[[[[0.1]]]], [[], [0.1]]], ids=["4d", "empty-first-row"])
def test_refused_before_either_leg(embeds):
    fake = FakeCluster({P1: FakeServer("prefill"), D1: FakeServer("decode")})

    async def go():
        async with gateway(fake) as client:
            return await client.post("/generate", json={"input_embeds": embeds})

    r = run(go())
    assert r.status_code == 400 and "input_embeds" in r.json()["error"]["message"], r.text
    assert not fake.servers[P1].received and not fake.servers[D1].received
