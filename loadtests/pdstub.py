"""A minimal, fast PD server pair for measuring proxies: `python -m loadtests.pdstub --help`.

One process serves a prefill port and one or more decode ports. It keeps the one PD rule a
proxy can break, and nothing of a model: every generation request must carry a bootstrap
room, the decode leg must name the prefill's bootstrap host and port, and a room is answered
only once both of its legs have arrived (each leg waits up to `--pair-timeout` for the other,
then fails with 500; a room is never accepted twice). Answers have SGLang's shapes (native
`/generate` and OpenAI chat/completions, streaming or not) with zero compute time, so the
proxy in front, not the servers, is what a benchmark measures.

Why not the simulator (`backends.sim`): it models SGLang faithfully, including the KV
handshake over HTTP between decode and prefill, and costs about 2-3 ms of CPU per PD request;
on one shared core that caps any proxy at a few hundred requests per second. This stub costs
a small fraction of that (raw asyncio protocol, httptools parser, prepared answers).

`--no-pairing` is for several stub processes behind one proxy (`loadtests.scaling`): the two
legs of a room may then reach different processes, which cannot meet, so each leg is answered
at once. Every leg must still carry a room, decode legs the bootstrap host and port (give every
process the same `--bootstrap-port`), and a room is refused if one role sees it twice.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import OrderedDict

import httptools
import orjson

MODEL = "stub-model"
WORDS = [f" w{i:02d}".encode() for i in range(100)]  # each "token" is one 4-byte word
TOMBSTONES = 200_000  # remembered finished rooms (reuse is refused)

JSON = b"application/json"
SSE = b"text/event-stream"


class Rooms:
    """Meeting point of the two legs of each bootstrap room (or, unpaired, a check that no
    role sees a room twice)."""

    def __init__(self, timeout: float, paired: bool = True) -> None:
        self.timeout = timeout
        self.paired = paired
        self.waiting: dict[int, tuple[str, asyncio.Future]] = {}
        self.done: OrderedDict[object, None] = OrderedDict()

    async def enter(self, room: int, role: str) -> str | None:
        """None when the leg may be answered, else the error message."""
        if self.paired:
            return await self.meet(room, role)
        if (room, role) in self.done:
            return f"Duplicate {role} bootstrap room {room}"
        self._finish((room, role))
        return None

    async def meet(self, room: int, role: str) -> str | None:
        """Wait for the other leg of `room`; None when paired, else the error message."""
        if room in self.done:
            return f"Duplicate or cancelled bootstrap room {room}"
        other = self.waiting.get(room)
        if other is not None:
            other_role, future = other
            if other_role == role:
                return f"Duplicate {role} bootstrap room {room}"
            del self.waiting[room]
            self._finish(room)
            if not future.done():
                future.set_result(None)
            return None
        future = asyncio.get_running_loop().create_future()
        self.waiting[room] = (role, future)
        try:
            await asyncio.wait_for(future, self.timeout)
            return None
        except TimeoutError:
            other_role = "decode" if role == "prefill" else "prefill"
            return f"Request {room} timed out after {self.timeout}s waiting for its {other_role} leg"
        finally:
            if self.waiting.get(room, (None, None))[1] is future:
                del self.waiting[room]
                self._finish(room)

    def _finish(self, room: object) -> None:
        self.done[room] = None
        if len(self.done) > TOMBSTONES:
            self.done.popitem(last=False)


class Server:
    def __init__(self, role: str, port: int, bootstrap_port: int, rooms: Rooms) -> None:
        self.role = role
        self.port = port
        self.bootstrap_port = bootstrap_port
        self.rooms = rooms
        self.running = 0
        self.info = orjson.dumps({
            "disaggregation_mode": role, "disaggregation_bootstrap_port": bootstrap_port,
            "served_model_name": MODEL, "model_path": MODEL, "tokenizer_path": MODEL,
            "dp_size": 1, "version": "pdstub"})
        self.models = orjson.dumps({"object": "list", "data": [
            {"id": MODEL, "object": "model", "owned_by": "pdstub", "max_model_len": 131072}]})
        self.model_info = orjson.dumps({"model_path": MODEL, "tokenizer_path": MODEL,
                                        "is_generation": True})

    def loads(self) -> bytes:
        return orjson.dumps(loads_answer(self.running))

    def get(self, path: str) -> tuple[int, bytes]:
        if path in ("/health", "/health_generate", "/ready"):
            return 200, b""
        if path in ("/server_info", "/get_server_info"):
            return 200, self.info
        if path == "/v1/loads":
            return 200, self.loads()
        if path == "/v1/models":
            return 200, self.models
        if path in ("/model_info", "/get_model_info"):
            return 200, self.model_info
        return 404, b'{"detail":"Not Found"}'

    def refusal(self, raw: bytes) -> tuple[dict | None, bytes | None]:
        """The parsed body, or the 400 answer a server in this role gives it."""
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return None, b"invalid JSON"
        if not isinstance(body, dict) or not isinstance(body.get("bootstrap_room"), int):
            return None, b"Disaggregated request received without bootstrap room id."
        if self.role == "decode" and (body.get("bootstrap_host") is None
                                      or body.get("bootstrap_port") != self.bootstrap_port):
            return None, b"decode request without the prefill's bootstrap host and port"
        return body, None

    async def generate(self, path: str, raw: bytes, reply: Reply) -> None:
        body, refused = self.refusal(raw)
        if body is None:
            reply.full(400, b'{"error":{"message":"%s"}}' % refused)
            return
        self.running += 1
        try:
            error = await self.rooms.enter(body["bootstrap_room"], self.role)
            if error is not None:
                reply.full(500, orjson.dumps(
                    {"object": "error", "message": error, "type": "500", "code": 500}))
            elif body.get("stream"):
                await reply.stream(_events(path, self.tokens(body)))
            else:
                reply.full(200, _answer(path, self.tokens(body)))
        finally:
            self.running -= 1

    def tokens(self, body: dict) -> int:
        """Output tokens: a prefill always answers one, as SGLang's does."""
        return 1 if self.role == "prefill" else _max_tokens(body)


def loads_answer(running: int) -> dict:
    """The stub's `/v1/loads` answer: one rank, a 400,000-token KV pool, `running` requests
    (loadtests.logic_cost --loads applies the same to the in-process gateway's servers)."""
    return {"loads": [{
        "dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": 0, "num_used_tokens": 0,
        "max_total_num_tokens": 400000, "max_running_requests": 4096, "token_usage": 0.0}]}


def _max_tokens(body: dict) -> int:
    params = body.get("sampling_params") or {}
    value = params.get("max_new_tokens", body.get("max_tokens", body.get(
        "max_completion_tokens", 16)))
    return max(1, int(value or 16))


def _text(tokens: int) -> bytes:
    return b"".join(WORDS[i % 100] for i in range(tokens))


def _answer(path: str, tokens: int) -> bytes:
    text = _text(tokens).decode()
    usage = {"prompt_tokens": 8, "completion_tokens": tokens, "total_tokens": 8 + tokens}
    if path == "/generate":
        return orjson.dumps({"text": text, "output_ids": list(range(tokens)), "meta_info": {
            "id": "stub", "finish_reason": {"type": "length", "length": tokens},
            "prompt_tokens": 8, "completion_tokens": tokens, "cached_tokens": 0}})
    if path == "/v1/chat/completions":
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "finish_reason": "length"}
        return orjson.dumps({"id": "stub", "object": "chat.completion", "created": 0,
                             "model": MODEL, "choices": [choice], "usage": usage})
    choice = {"index": 0, "text": text, "finish_reason": "length"}
    return orjson.dumps({"id": "stub", "object": "text_completion", "created": 0,
                         "model": MODEL, "choices": [choice], "usage": usage})


def _events(path: str, tokens: int):
    """The SSE events of a stream, one bytes object per event."""
    if path == "/generate":
        text = b""
        for i in range(tokens):
            text += WORDS[i % 100]
            finish = b'{"type":"length","length":%d}' % tokens if i == tokens - 1 else b"null"
            yield (b'data: {"text":"%s","meta_info":{"id":"stub","finish_reason":%s,'
                   b'"completion_tokens":%d}}\n\n' % (text, finish, i + 1))
    else:
        chat = path == "/v1/chat/completions"
        kind = b"chat.completion.chunk" if chat else b"text_completion"
        for i in range(tokens):
            word = WORDS[i % 100]
            piece = b'"delta":{"content":"%s"}' % word if chat else b'"text":"%s"' % word
            finish = b'"length"' if i == tokens - 1 else b"null"
            yield (b'data: {"id":"stub","object":"%s","model":"%s","choices":[{"index":0,%s,'
                   b'"finish_reason":%s}]}\n\n' % (kind, MODEL.encode(), piece, finish))
    yield b"data: [DONE]\n\n"


class Reply:
    """Writes one response on a connection (Content-Length, or chunked for a stream)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def full(self, status: int, body: bytes, content_type: bytes = JSON) -> None:
        head = b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n" % (
            status, _REASONS.get(status, b"Error"), content_type, len(body))
        self.conn.write(head + body)

    async def stream(self, events) -> None:
        conn = self.conn
        conn.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                   b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n")
        for event in events:
            if conn.closed:
                return
            conn.write(b"%x\r\n%s\r\n" % (len(event), event))
            await conn.drained()  # one event per turn of the loop: streams interleave
        conn.write(b"0\r\n\r\n")


_REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 500: b"Internal Server Error"}


class Connection(asyncio.Protocol):
    def __init__(self, server: Server) -> None:
        self.server = server
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.url = b""
        self.body: list[bytes] = []
        self.queue: asyncio.Queue = asyncio.Queue()  # requests, answered in order
        self.task: asyncio.Task | None = None
        self.writable = asyncio.Event()
        self.writable.set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.task = asyncio.get_running_loop().create_task(self._serve())

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.writable.set()
        if self.task is not None:
            self.task.cancel()

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        method = self.parser.get_method()
        path = self.url.split(b"?", 1)[0].decode()
        self.queue.put_nowait((method, path, b"".join(self.body), self.parser.should_keep_alive()))
        self.url, self.body = b"", []

    def write(self, data: bytes) -> None:
        if not self.closed:
            self.transport.write(data)

    async def drained(self) -> None:
        await asyncio.sleep(0)
        if not self.writable.is_set():
            await self.writable.wait()

    async def _serve(self) -> None:
        while True:
            method, path, body, keep_alive = await self.queue.get()
            reply = Reply(self)
            if method == b"POST" and path in ("/generate", "/v1/completions",
                                              "/v1/chat/completions"):
                try:
                    await self.server.generate(path, body, reply)
                except (ValueError, TypeError) as exc:  # e.g. a max_tokens that is no number
                    reply.full(400, orjson.dumps({"error": {"message": str(exc)}}))
            elif method == b"GET":
                reply.full(*self.server.get(path))
            elif method == b"POST" and path in ("/flush_cache", "/abort_request"):
                reply.full(200, b"{}")
            else:
                reply.full(404, b'{"detail":"Not Found"}')
            if not keep_alive:
                self.transport.close()
                return


async def serve(host: str, prefill_port: int, bootstrap_port: int, decode_ports: list[int],
                pair_timeout: float, paired: bool = True) -> None:
    rooms = Rooms(pair_timeout, paired)
    loop = asyncio.get_running_loop()
    servers = [Server("prefill", prefill_port, bootstrap_port, rooms)]
    servers += [Server("decode", port, bootstrap_port, rooms) for port in decode_ports]
    listeners = [await loop.create_server(lambda s=s: Connection(s), host, s.port, backlog=2048)
                 for s in servers]
    print(f"pdstub ready at {time.strftime('%X')}: prefill {prefill_port} (bootstrap "
          f"{bootstrap_port}), decode {', '.join(map(str, decode_ports))}", flush=True)
    await asyncio.gather(*(listener.serve_forever() for listener in listeners))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtests.pdstub", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--prefill-port", type=int, required=True)
    parser.add_argument("--bootstrap-port", type=int, default=8998,
                        help="bootstrap port the prefill reports and decode legs must name")
    parser.add_argument("--decode-port", type=int, action="append", required=True,
                        help="a decode port (repeat for more decode servers)")
    parser.add_argument("--pair-timeout", type=float, default=5.0,
                        help="seconds a leg waits for the other leg of its room")
    parser.add_argument("--no-pairing", action="store_true",
                        help="answer each leg at once (the other may go to another process)")
    args = parser.parse_args(argv)
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    runner(serve(args.host, args.prefill_port, args.bootstrap_port, args.decode_port,
                 args.pair_timeout, paired=not args.no_pairing))


if __name__ == "__main__":
    main()
