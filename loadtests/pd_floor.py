"""A measuring stick, not a product: the least a PD proxy in Python can do per request, on the
gateway's own server protocol and upstream client.

    python -m loadtests.pd_floor --port 8000 --prefill http://127.0.0.1:30000 8998 \
        --decode http://127.0.0.1:30001

Each POST's JSON body gets a random bootstrap room and the prefill's bootstrap host and port,
goes to the prefill (in a task) and to a decode (in turn) at once, and the decode's answer goes
back in one write (`uvicorn_send.UvicornSend.whole`). No policies, retries, deadlines, accounting,
metrics, auth or streaming. The overhead benchmark's `python-floor` target runs it beside the
gateway: the gap between the two is the gateway's own work, the gap between it and the Rust
router what Python's sockets, parsers and event loop cost.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
from urllib.parse import urlsplit

import orjson
import uvicorn

from gateway.cli import tune_gc
from gateway.routes.asgi import read_body
from gateway.routes.server_protocol import WHOLE, ServerLimits, guarded_protocol
from gateway.timers import Timers
from gateway.upstream.http11 import HTTPClient

HEADERS = [(b"content-type", b"application/json")]


def build(prefill: str, bootstrap_port: int, decodes: list[str], client=None):
    """The floor's ASGI app; `client`: its upstream (`loadtests.logic_cost` gives one that
    answers in memory), else the gateway's own HTTP client."""
    client = client or HTTPClient(connect_timeout=5.0)
    host = urlsplit(prefill).hostname
    turn = itertools.cycle(decodes)

    async def leg(url: str, path: str, body: bytes) -> bytes:
        response = await client.post(url, path, body, b"X-Request-Id: floor\r\n")
        return await response.read()

    async def app(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["method"] != "POST":
            await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
            await send({"type": "http.response.body", "body": b"{}"})
            return
        body = orjson.loads(await read_body(scope, receive, 1 << 20))
        body.update(bootstrap_host=host, bootstrap_port=bootstrap_port,
                    bootstrap_room=random.getrandbits(63))
        payload = orjson.dumps(body)
        prefilled = asyncio.get_running_loop().create_task(leg(prefill, scope["path"], payload))
        answer = await leg(next(turn), scope["path"], payload)
        await prefilled
        if not scope[WHOLE](200, HEADERS, answer):
            await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
            await send({"type": "http.response.body", "body": answer})

    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.pd_floor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--prefill", nargs=2, metavar=("URL", "BOOTSTRAP_PORT"), required=True)
    p.add_argument("--decode", action="append", required=True)
    args = p.parse_args(argv)
    app = build(args.prefill[0], int(args.prefill[1]), args.decode)
    tune_gc()  # as the gateway does
    uvicorn.run(app, host=args.host, port=args.port, loop="uvloop", ws="none",
                http=guarded_protocol(ServerLimits(), Timers()), log_level="warning",
                access_log=False, server_header=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
