"""POST /v1/responses: the turn prepared here, served by the inference endpoint, kept here.

The caller is identified first (without spending its key's request rate: the inference
endpoint checks the role and charges it, and answers a caller without the role itself). The
body is read, its history expanded from the store (gateway/responses/service.py), and the
inference endpoint gets the prepared body as if the client had sent it: auth, admission,
routing on the whole conversation, both legs with their bootstrap fields, retries before the
first event and the relay are the chat path's. What it sends is watched on the way out: the
final response (the whole JSON answer, or a stream's `response.completed`, `.incomplete` or
`.failed` event) is kept BEFORE those bytes go to the client, so a client that sends its next
turn as soon as it has this one finds it. The final save and a cancel race for the record
(service.py): when the cancel won, the client is sent the final response as `cancelled`.
"""

from __future__ import annotations

import orjson
from starlette.types import Message, Receive, Scope, Send

from gateway.admission.auth import INFERENCE, PUBLIC, Auth
from gateway.admission.body_budget import BodyBudget
from gateway.errors import GatewayError
from gateway.responses.service import Responses, Turn
from gateway.routes.asgi import ClientGone, read_body, send_error
from gateway.routes.inference import InferenceEndpoint, request_id_of
from gateway.routes.server_protocol import CHUNKS, WHOLE
from gateway.sse import EventSplitter, decoded, split_events, with_data

FINAL_TYPES = frozenset({"response.completed", "response.incomplete", "response.failed"})


class ResponsesEndpoint:
    def __init__(self, inner: InferenceEndpoint, auth: Auth, responses: Responses,
                 max_body_bytes: int, bodies: BodyBudget) -> None:
        self.inner = inner
        self.auth = auth
        self.responses = responses
        self.max_body_bytes = max_body_bytes
        self.bodies = bodies  # the upload counts in flight; the inner endpoint then charges
        # the prepared body (the conversation expanded) as it reads it again

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            caller = self.auth.caller(scope, PUBLIC)
        except GatewayError:
            caller = None
        if caller is None or INFERENCE not in caller.roles:
            await self.inner(scope, receive, send)  # it refuses the caller in its own words
            return
        lease = self.bodies.lease()
        try:
            raw = await read_body(scope, receive, self.max_body_bytes, lease=lease)
            turn = await self.responses.begin(caller.tenant, raw)
            del raw  # the turn holds the prepared body, which the inner endpoint charges
        except GatewayError as err:
            await send_error(send, err, request_id_of(scope))
            return
        except (ClientGone, OSError):
            return
        finally:
            lease.release()
        _prepared(scope, len(turn.body))
        watch = AnswerWatch(self.responses, turn, send)
        try:
            await self.inner(scope, _replay(turn.body, receive), watch.send)
        finally:
            self.responses.end(turn)
            if turn.store and not watch.done:  # refused, failed or cut: not in progress
                await self.responses.keep(turn, failed(turn, watch.status))


def _prepared(scope: Scope, length: int) -> None:
    """The scope for the prepared body: its length, and every write through `send` (the
    server protocol's direct writes would pass the watch by)."""
    scope["headers"] = [(k, v) for k, v in scope["headers"] if k != b"content-length"] + [
        (b"content-length", str(length).encode())]
    scope.pop(WHOLE, None)
    scope.pop(CHUNKS, None)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The prepared body as the request's one message, then the client's own messages (its
    disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


def failed(turn: Turn, status: int) -> dict:
    """The response of a turn that ended without one (what GET shows of it)."""
    return {"id": turn.rid, "object": "response", "status": "failed", "output": [],
            "error": {"code": "server_error",
                      "message": f"the request ended without a response (HTTP {status})"}}


def restorer(turn: Turn):
    """What the client asked, back in the answer: the servers were sent `store: false` and no
    `previous_response_id` (the gateway holds the state), so the response they made says
    so; the client reads its own values. A byte replacement: inside a JSON string every `"`
    is escaped, so these bytes only occur as keys (as SGLang and the simulator write JSON)."""
    swaps = []
    if turn.store:
        swaps.append((b'"store":false', b'"store":true'))
    if turn.previous is not None:
        swaps.append((b'"previous_response_id":null',
                      b'"previous_response_id":' + orjson.dumps(turn.previous)))

    def restore(data: bytes) -> bytes:
        for old, new in swaps:
            if old in data:
                data = data.replace(old, new)
        return data

    return restore if swaps else None


class AnswerWatch:
    """The answer on its way to the client: the client's own values restored, the final
    response kept before it is sent."""

    def __init__(self, responses: Responses, turn: Turn, send: Send) -> None:
        self.responses = responses
        self.turn = turn
        self._send = send
        self.status = 0
        self.stream = False
        self.events = EventSplitter()  # a stream's event cut by a chunk waits for its end, so
        # the final one is kept, and rewritten if a cancel won, before any byte of it goes out
        self.parts: list[bytes] = []
        self.done = False
        self.restore = restorer(turn)
        self.head: Message | None = None  # a whole answer's head, sent with its body

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            for name, value in message.get("headers", ()):
                if name == b"content-type" and value.startswith(b"text/event-stream"):
                    self.stream = True
            if self.status == 200 and not self.stream:
                self.head = message  # its length follows the restored body
                return
        elif message["type"] == "http.response.body" and self.status == 200:
            message = await self._body(message)
            if message is None:
                return
        await self._send(message)

    async def _body(self, message: Message) -> Message | None:
        body = message.get("body", b"")
        more = message.get("more_body", False)
        if not self.stream:
            self.parts.append(body)
            if more:
                return None
            body = b"".join(self.parts)
            self.parts.clear()
        else:
            body = self.events.whole(body, ended=not more)
            if not body and more:
                return None
        if self.restore is not None:
            body = self.restore(body)
        if not self.done:
            body = await (self._keep_final_event(body) if self.stream
                          else self._keep_whole(body))
        if self.head is not None:
            headers = [(k, v) for k, v in self.head.get("headers", ())
                       if k != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            await self._send({**self.head, "headers": headers})
            self.head = None
        return {"type": "http.response.body", "body": body, "more_body": more}

    async def _cancelled(self, final: dict) -> bool:
        """Keep the final response; True when a cancel won the record first: the client is
        then sent it cancelled, as GET and the cancel's answer say."""
        self.done = True
        if not self.turn.store or await self.responses.keep(self.turn, final) != "cancelled":
            return False
        final["status"] = "cancelled"
        return True

    async def _keep_whole(self, body: bytes) -> bytes:
        try:
            answer = orjson.loads(body)
        except orjson.JSONDecodeError:
            return body
        if not (isinstance(answer, dict) and answer.get("object") == "response"):
            return body
        return orjson.dumps(answer) if await self._cancelled(answer) else body

    async def _keep_final_event(self, body: bytes) -> bytes:
        """`body` (whole events), its final event kept. When a cancel won, the events are
        framed again (lines ended by "\n"), the final one with its changed data in one line:
        a proxy may have split that data over several lines, or ended them otherwise."""
        events = split_events(body)
        for i, (event, _, obj) in enumerate(decoded(events)):
            if isinstance(obj, dict) and obj.get("type") in FINAL_TYPES:
                response = obj.get("response")
                if not isinstance(response, dict) or not await self._cancelled(response):
                    return body
                events[i] = with_data(event, obj)
                return b"".join(e if j == i else e + b"\n\n" for j, e in enumerate(events))
        return body
