"""The context check decides by size first: a prompt its size proves over the context is
refused without tokenizing; a prompt near the limit that nothing can count is refused with
503 + Retry-After, never forwarded unchecked."""

import asyncio
import tracemalloc

import httpx
import orjson
import pytest

from backends.tiny_tokenizer import train, write_model
from gateway.request import CHAT, GENERATE, parse_request
from gateway.tokens import context_check
from gateway.tokens.context_check import fewest_tokens
from gateway.tokens.prompt_tokens import _shrink, longest_token_bytes
from gateway.tokens.tokenizer import load_tokenizer
from tests.unit.fakes import FakeCluster, FakeServer
from tests.unit.fakes import served_gateway as gateway

P1, D1, D2 = "http://127.0.0.1:30000", "http://127.0.0.1:30001", "http://127.0.0.1:30003"
CONTEXT = 100
TEXTS = ["hello world " * 50, "語" * 300, "ab" * 400, " " * 700, "a\u0301" * 200,
         "<|user|>" * 40 + "x" * 17 * 30, "".join(chr(c) for c in range(32, 2000))]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("model"), train())


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_the_size_bound_never_exceeds_the_true_count(model, text):
    """Soundness: no text tokenizes to fewer tokens than its characters / token_bytes."""
    tok = load_tokenizer(model)
    token_bytes = longest_token_bytes(tok.backend)
    assert token_bytes is not None
    view = parse_request(GENERATE, orjson.dumps({"text": text}))
    assert len(tok.encode_text(text)) >= fewest_tokens(view, token_bytes)
    chat = {"messages": [{"role": "system", "content": text[:50]},
                         {"role": "user", "content": text}]}
    chat_view = parse_request(CHAT, orjson.dumps(chat))
    assert len(tok.encode_chat(chat)) >= fewest_tokens(chat_view, token_bytes)


@pytest.mark.parametrize("normalizer, factor", [
    (None, 1), ({"type": "NFC"}, 3), ({"type": "StripAccents"}, None),
    ({"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "Lowercase"}]}, 12),
    ({"type": "Replace", "pattern": {"String": " "}, "content": "▁"}, 1),
    ({"type": "Replace", "pattern": {"String": "abcd"}, "content": "x"}, 4),
], ids=["none", "nfc", "strip-accents-no-bound", "sequence", "space-to-metaspace", "shrinking"])
def test_how_far_a_normalizer_can_shrink_a_text(normalizer, factor):
    assert _shrink(normalizer) == factor


def cluster(tokenize_fails: bool = False, tokenize_hangs: bool = False) -> FakeCluster:
    info = {"context_length": CONTEXT}
    fake = FakeCluster({P1: FakeServer("prefill", info=info),
                        D1: FakeServer("decode", info=info)})
    handle = fake.handle

    async def scripted(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/tokenize":
            if tokenize_hangs:
                await asyncio.Event().wait()
            if tokenize_fails:
                return httpx.Response(500, json={"error": {"message": "tokenizer down"}})
        return await handle(request)

    fake.handle = scripted
    return fake


def post(fake, body: dict, *extra: str):
    async def go():
        async with gateway(fake, *extra) as (client, gw):
            r = await client.post("/generate", json=body)
            return r, gw

    return asyncio.run(asyncio.wait_for(go(), 20))


def test_a_prompt_its_size_proves_over_is_refused_without_tokenizing(model):
    text = "ab " * 1000  # 3000 characters: over 100 tokens of at most 17 bytes each
    fake = cluster()
    r, gw = post(fake, {"text": text}, "--tokenizer", str(model))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and "by its size" in error["message"]
    assert gw.tokens.counted == 0  # the tokenizer here was not asked
    assert fake.servers[D1].tokenized == 0 and not fake.servers[D1].received
    assert not fake.servers[P1].received


@pytest.mark.parametrize("how", ["fails", "hangs"])
def test_a_near_limit_prompt_nothing_can_count_is_refused_not_forwarded(monkeypatch, how):
    monkeypatch.setattr(context_check, "TOKENIZE_TIMEOUT", 0.2)
    fake = cluster(tokenize_fails=how == "fails", tokenize_hangs=how == "hangs")
    r, _ = post(fake, {"text": "x" * 260})  # no tokenizer here: only a server could count
    assert r.status_code == 503, r.text
    assert int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["code"] == "context_check_unavailable"
    assert not fake.servers[D1].received and not fake.servers[P1].received
    short, _ = post(fake, {"text": "short"})  # far below the limit: no count needed
    assert short.status_code == 200


def test_a_hung_server_first_in_line_hands_the_count_to_the_next():
    """The servers are asked in turn as count_tokens asks them (`ask_in_turn.InTurn`): a
    decode whose /v1/tokenize hangs is first for one count of two, and is hedged after its
    head start (1 s), the next decode's count deciding. Before, they were asked one after the
    other, the first always first: the hung one held every count to the deadline (503)."""
    info = {"context_length": CONTEXT}
    fake = FakeCluster({P1: FakeServer("prefill", info=info), D1: FakeServer("decode", info=info),
                        D2: FakeServer("decode", info=info)})
    handle, hung = fake.handle, []

    async def scripted(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/tokenize" and str(request.url).startswith(D1):
            hung.append(request)
            await asyncio.Event().wait()
        return await handle(request)

    fake.handle = scripted

    async def go():
        async with gateway(fake) as (client, _):
            return [await client.post("/generate", json={"text": "x" * 260}) for _ in range(2)]

    answers = asyncio.run(asyncio.wait_for(go(), 20))
    assert [r.status_code for r in answers] == [400, 400], answers[0].text
    assert all("the prompt has 130 tokens" in r.json()["error"]["message"] for r in answers)
    assert len(hung) == 1 and fake.servers[D2].tokenized == 2
    assert not fake.servers[D1].received and not fake.servers[D2].received


def test_a_large_prompt_is_counted_by_a_server_in_one_deadline():
    """Without a tokenizer here, a large prompt goes to /v1/tokenize (in slices, the body's
    length declared) and the server's count decides: 400, nothing forwarded."""
    fake = cluster()
    text = "x" * (3 << 20)
    r, _ = post(fake, {"text": text})
    assert r.status_code == 400, r.text
    assert f"the prompt has {len(text) // 2} tokens" in r.json()["error"]["message"]
    assert fake.servers[D1].tokenized == 1 and not fake.servers[D1].received


def test_a_servers_count_is_read_without_holding_its_token_list():
    """SGLang's /v1/tokenize lists every token id before the count: the answer is scanned as
    it streams (the count found even when a read ends inside it), never parsed whole (a
    million ids would be ~36 MB of Python ints)."""
    ids = b",".join(b"%d" % (100_000 + i) for i in range(1_000_000))
    answer = b'{"tokens":[' + ids + b'],"count": 1000000,"max_model_len":100}'
    cut = answer.index(b'"count": 1000000') + len(b'"count": 100')  # a read ends in it
    pieces = [answer[i:i + 65536] for i in range(0, cut, 65536)]
    pieces[-1] = answer[(len(pieces) - 1) * 65536:cut]
    pieces.append(answer[cut:])
    fake = cluster()
    handle = fake.handle

    async def scripted(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/tokenize":
            return httpx.Response(200, stream=_Pieces(pieces))
        return await handle(request)

    fake.handle = scripted
    tracemalloc.start()
    try:
        r, _ = post(fake, {"text": "x" * 300})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert r.status_code == 400, r.text
    assert "the prompt has 1000000 tokens" in r.json()["error"]["message"]
    assert peak < 16 << 20, f"{peak >> 20} MB traced at the peak"


class _Pieces(httpx.AsyncByteStream):
    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    async def __aiter__(self):
        for piece in self.pieces:
            yield piece
