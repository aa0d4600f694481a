"""The inference endpoints as pure ASGI apps: the request path, kept short.

read body -> auth -> parse once -> admission slot -> proxy (pick, dispatch, retry) -> answer.
A task watches the client connection for the whole request: when the client goes away,
the work is cancelled, which cancels both upstream legs.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from starlette.types import Receive, Scope, Send

from gateway.errors import GatewayError
from gateway.pd import Answer
from gateway.request import parse_request
from gateway.routes.asgi import ClientGone, header, read_body, send_error


class InferenceEndpoint:
    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gw = scope["app"].state.gateway
        started = time.perf_counter()
        request_id = header(scope, b"x-request-id") or uuid.uuid4().hex
        status = 500
        try:
            gw.inference_keys.check(header(scope, b"authorization"), header(scope, b"x-api-key"))
            raw = await read_body(scope, receive, gw.config.max_body_bytes)
            view = parse_request(self.endpoint, raw)
            async with gw.admission.slot():
                status = await self._serve(gw, view, request_id, receive, send, started)
        except GatewayError as err:
            status = err.status
            await send_error(send, err, request_id)
        except (ClientGone, OSError):
            status = 499
        finally:
            m = gw.metrics
            m.requests.labels(self.endpoint, str(status)).inc()
            m.e2e.labels(self.endpoint).observe(time.perf_counter() - started)
            if status == 499:
                m.disconnects.labels(self.endpoint).inc()

    async def _serve(self, gw, view, request_id: str, receive: Receive, send: Send,
                     started: float) -> int:
        """Run the proxy and send its answer, both raced against a client disconnect."""
        loop = asyncio.get_running_loop()
        watcher = loop.create_task(_wait_disconnect(receive))
        try:
            work = loop.create_task(gw.proxy.handle(view, request_id))
            if not await _race(work, watcher):
                return 499
            answer: Answer = work.result()
            work = loop.create_task(self._send_answer(gw, answer, request_id, send, started))
            try:
                if not await _race(work, watcher):
                    return 499
            finally:
                if answer.close is not None:
                    await answer.close()
            return work.result()
        finally:
            watcher.cancel()

    async def _send_answer(self, gw, answer: Answer, request_id: str, send: Send,
                           started: float) -> int:
        headers = [(b"content-type", answer.content_type),
                   (b"x-request-id", request_id.encode())]
        m = gw.metrics
        if answer.stream is None:
            headers.append((b"content-length", str(len(answer.body)).encode()))
            await send({"type": "http.response.start", "status": answer.status,
                        "headers": headers})
            await send({"type": "http.response.body", "body": answer.body})
            m.ttft.labels(self.endpoint, "false").observe(time.perf_counter() - started)
            m.stream_bytes.labels(self.endpoint).inc(len(answer.body))
            return answer.status
        headers.append((b"cache-control", b"no-cache"))
        headers.append((b"x-accel-buffering", b"no"))
        await send({"type": "http.response.start", "status": answer.status, "headers": headers})
        itl = m.itl.labels(self.endpoint)
        sent = 0
        last = 0.0
        async for chunk in answer.stream:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            now = time.perf_counter()
            if last:
                itl.observe(now - last)
            else:
                m.ttft.labels(self.endpoint, "true").observe(now - started)
            last = now
            sent += len(chunk)
        await send({"type": "http.response.body", "body": b""})
        m.stream_bytes.labels(self.endpoint).inc(sent)
        return answer.status


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _race(work: asyncio.Task, watcher: asyncio.Task) -> bool:
    """Wait for `work`; False (work cancelled) if the client disconnected first."""
    await asyncio.wait((work, watcher), return_when=asyncio.FIRST_COMPLETED)
    if work.done():
        return True
    work.cancel()
    try:
        await work
    except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the client is gone anyway
        pass
    return False
