"""The in-flight body budget: bodies beyond it get a JSON 503 with Retry-After, and a request
gives its bytes back however it ends (answered, refused, failed upstream, client gone)."""

import asyncio

import orjson
import pytest

from gateway.admission.body_budget import BodyBudget
from gateway.errors import ServiceUnavailable
from tests.unit.fakes import FakeCluster, FakeServer, make_app, run

P1, D1 = "http://127.0.0.1:30000", "http://127.0.0.1:30001"
BUDGET = 8192  # --max-body-bytes and --max-inflight-body-bytes alike
ARGS = ("--max-body-bytes", str(BUDGET), "--max-inflight-body-bytes", str(BUDGET))


def chat(size: int) -> bytes:
    """A chat body of exactly `size` bytes."""
    head, tail = b'{"messages":[{"role":"user","content":"', b'"}],"max_tokens":2}'
    return head + b"x" * (size - len(head) - len(tail)) + tail


class Client:
    """One request driven by hand: the body sent in the pieces the test gives, the answer
    collected from the app's sends."""

    def __init__(self, app, size: int) -> None:
        self.app = app
        self.size = size
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.status = 0
        self.headers: dict[bytes, bytes] = {}
        self.body = b""
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/chat/completions",
                 "raw_path": b"/v1/chat/completions", "query_string": b"", "root_path": "",
                 "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                             (b"content-length", str(self.size).encode())],
                 "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 80), "extensions": {}}
        await self.app(scope, self.inbox.get, self._send)

    async def _send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = {k.lower(): v for k, v in message["headers"]}
        elif message["type"] == "http.response.body":
            self.body += message.get("body", b"")

    def give(self, chunk: bytes, more: bool) -> None:
        self.inbox.put_nowait({"type": "http.request", "body": chunk, "more_body": more})

    def leave(self) -> None:
        self.inbox.put_nowait({"type": "http.disconnect"})

    async def answer(self) -> int:
        await asyncio.wait_for(asyncio.shield(self.task), 10)
        return self.status


async def whole(app, body: bytes) -> Client:
    client = Client(app, len(body))
    client.give(body, False)
    await client.answer()
    return client


def cluster(decode_status: int = 200) -> FakeCluster:
    return FakeCluster({P1: FakeServer("prefill"), D1: FakeServer("decode", status=decode_status)})


@pytest.mark.parametrize("ending", ["answered", "bad-json", "client-gone"])
def test_a_held_body_refuses_others_and_gives_its_bytes_back(ending):
    """A body half received holds its bytes: another that would cross the budget gets a 503
    JSON error with Retry-After at once; once the first ends, its bytes are back (a body of
    the whole budget passes)."""
    fake = cluster()

    async def go():
        app = make_app(fake, *ARGS)
        async with app.router.lifespan_context(app):
            body = chat(BUDGET // 2 + 100)
            held = Client(app, len(body))
            cut = BUDGET // 2 + 50
            held.give(body[:cut], True)  # most of it: held while the rest is awaited
            await asyncio.sleep(0.05)
            refused = await whole(app, chat(BUDGET // 2))
            assert refused.status == 503
            assert int(refused.headers[b"retry-after"]) >= 1
            error = orjson.loads(refused.body)["error"]
            assert error["code"] == "body_budget_exhausted" and "retry" in error["message"]
            small = await whole(app, chat(BUDGET // 2 - 200))  # fits beside it: served
            assert small.status == 200
            if ending == "answered":
                held.give(body[cut:], False)
            elif ending == "bad-json":
                held.give(b"}" * (len(body) - cut), False)
            else:
                held.leave()
            status = await held.answer()
            # (a client gone gets no answer at all)
            assert status == {"answered": 200, "bad-json": 400, "client-gone": 0}[ending]
            full = await whole(app, chat(BUDGET))
            assert full.status == 200, full.body

    run(go())


def test_a_failed_request_gives_its_bytes_back():
    """Every request fails upstream (502); the budget is whole afterwards, request after
    request (a leak would refuse the third full-budget body)."""
    fake = cluster(decode_status=500)

    async def go():
        app = make_app(fake, *ARGS, "--max-attempts", "2")
        async with app.router.lifespan_context(app):
            for _ in range(3):
                failed = await whole(app, chat(BUDGET))
                assert failed.status == 502, failed.body

    run(go())


def test_the_budget_counts_chunks_and_is_never_below_one_body():
    budget = BodyBudget(1000, max_body=4000)
    assert budget.limit == 4000  # a lone body of --max-body-bytes always fits
    budget.take(3000)
    with pytest.raises(ServiceUnavailable) as info:
        budget.take(1001)
    assert info.value.headers["Retry-After"] and info.value.status == 503
    assert budget.used == 3000 and budget.refused == 1
    budget.check(1000)  # fits exactly
