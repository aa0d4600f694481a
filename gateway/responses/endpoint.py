"""POST /v1/responses: the turn prepared here, served by the inference endpoint, kept here.

The caller is identified here, once, its key's request rate charged (the inference endpoint
is handed that caller, or this refusal, through `Identified`: no second check or charge, and a
refused request never has its body read nor its history fetched). The body is read, its
history expanded from the store (turns.prepare: nothing written yet), and the inference
endpoint gets the prepared body as if the client had sent it: parse, model, context,
admission, routing on the whole conversation, both legs with their bootstrap fields, retries
before the first event and the relay are the chat path's. The turn's in_progress record is
written only when that endpoint asks the servers (`_dispatch`), so a request it refused
(rate, model, context, a full queue) leaves nothing in the store. What it sends is watched
on the way out: the final response (the whole JSON answer, or a stream's
`response.completed`, `.incomplete` or `.failed` event) is kept BEFORE those bytes go to the
client, so a client that sends its next turn as soon as it has this one finds it. The final
save and a cancel race for the record (service.py): when the cancel won, the client is sent
the final response as `cancelled`. Whatever fails here unexpectedly is a JSON 500, as on the
other endpoints, never a plain-text one.
"""

from __future__ import annotations

import dataclasses
import logging
from contextvars import ContextVar

import orjson
from starlette.types import Message, Receive, Scope, Send

from gateway.admission.auth import INFERENCE, Auth, Caller, Role
from gateway.admission.body_budget import BodyBudget
from gateway.dispatch.attempt import Answer
from gateway.dispatch.inflight import Tracked
from gateway.errors import GatewayError
from gateway.request import RequestView
from gateway.responses import turns
from gateway.responses.service import Responses, Turn
from gateway.responses.stream_end import FAILED, StreamEnd, cut, failed, gateway_error
from gateway.routes.asgi import ClientGone, read_body, send_error
from gateway.routes.inference import InferenceEndpoint, request_id_of
from gateway.routes.server_protocol import CHUNKS, WHOLE
from gateway.sse import EventSplitter, decoded, split_events, with_data

log = logging.getLogger("gateway.responses")

FINAL_TYPES = frozenset({"response.completed", "response.incomplete", "response.failed"})
CALLER = "gateway.responses.caller"  # the scope's key: the caller identified here, or its
# refusal (a GatewayError), for the inference endpoint (`Identified`)


@dataclasses.dataclass(slots=True, eq=False)
class Pending:
    """A prepared turn waiting for dispatch; `dispatched`: the servers were asked, and its
    record written then (when kept)."""

    turn: Turn
    placeholder: dict | None  # its in_progress response (None: not kept)
    dispatched: bool = False


PENDING: ContextVar[Pending | None] = ContextVar("responses_pending", default=None)


class Identified:
    """The inference endpoint's `auth` on this route: the caller `ResponsesEndpoint`
    identified, whose key's rate it charged, or the refusal it got; never a second check."""

    def __init__(self, auth: Auth) -> None:
        self.auth = auth

    def caller(self, scope: Scope, needed: Role | tuple[Role, ...]) -> Caller:
        found = scope.get(CALLER)
        if found is None:  # not through ResponsesEndpoint
            return self.auth.caller(scope, needed)
        if isinstance(found, GatewayError):
            raise found
        return found


class ResponsesEndpoint:
    def __init__(self, inner: InferenceEndpoint, auth: Auth, responses: Responses,
                 max_body_bytes: int, bodies: BodyBudget) -> None:
        self.inner = inner
        self.auth = auth
        self.responses = responses
        self.max_body_bytes = max_body_bytes
        self.bodies = bodies  # the upload counts in flight; the inner endpoint then charges
        # the prepared body (the conversation expanded) as it reads it again
        self._serve = inner.parts.serve
        inner.parts = dataclasses.replace(inner.parts, auth=Identified(auth),
                                          serve=self._dispatch)  # this route's own inner

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watch: AnswerWatch | None = None
        try:
            pending = await self._prepare(scope, receive, send)
            if pending is None:
                return
            watch = AnswerWatch(self.responses, pending.turn, send)
            await self._run(scope, receive, pending, watch)
        except Exception:  # a bug: a JSON 500 as the other endpoints answer, no traceback
            await self._internal_error(scope, send, watch is not None and watch.started)

    async def _prepare(self, scope: Scope, receive: Receive, send: Send) -> Pending | None:
        """The caller identified and charged, the body read, its turn prepared (nothing
        stored); None when refused (answered: a refused caller by the inference endpoint, so
        it is counted there as on every route)."""
        try:
            scope[CALLER] = self.auth.caller(scope, INFERENCE)
        except GatewayError as refused:
            scope[CALLER] = refused
            await self.inner(scope, receive, send)  # it refuses the caller in its own words
            return None
        lease = self.bodies.lease()
        try:
            raw = await read_body(scope, receive, self.max_body_bytes, lease=lease)
            turn, placeholder = await turns.prepare(self.responses, scope[CALLER].tenant, raw)
            del raw  # the turn holds the prepared body, which the inner endpoint charges
        except GatewayError as err:
            await send_error(send, err, request_id_of(scope))
            return None
        except (ClientGone, OSError):
            return None
        finally:
            lease.release()
        return Pending(turn, placeholder)

    async def _run(self, scope: Scope, receive: Receive, pending: Pending,
                   watch: AnswerWatch) -> None:
        """The inference endpoint serves the prepared body; a dispatched turn that ended
        without its final response is kept as failed."""
        turn = pending.turn
        _prepared(scope, len(turn.body))
        waiting, client_cut = PENDING.set(pending), False
        try:
            await self.inner(scope, _replay(turn.body, receive), watch.send)
            # a begun stream ended without its final event, yet no server failed (a failed
            # decode ends it with `response.failed`): the client cut it
            client_cut = watch.stream and watch.status == 200
        finally:
            PENDING.reset(waiting)
            self.responses.end(turn)
            if pending.dispatched and turn.store and not watch.done:  # failed or cut
                await self.responses.keep(turn, cut(turn) if client_cut
                                          else failed(turn, watch.status))

    async def _dispatch(self, view: RequestView, tracked: Tracked) -> Answer:
        """The inference endpoint asks the servers now: every check that refuses a request
        before them passed, so the turn's record is written here, never for a refused one."""
        pending = PENDING.get()
        if pending is not None and not pending.dispatched:
            pending.dispatched = True
            await turns.start(self.responses, pending.turn, pending.placeholder)
        return await self._serve(view, tracked)

    async def _internal_error(self, scope: Scope, send: Send, started: bool) -> None:
        request_id = request_id_of(scope)
        log.exception("unexpected error on /v1/responses (request %s)", request_id)
        if started:  # the answer began: the client sees it cut
            return
        err = GatewayError("internal gateway error; see the gateway log", status=500)
        self.inner.parts.state.note_error(err, self.inner.endpoint, request_id)
        try:
            await send_error(send, err, request_id)
        except Exception:  # noqa: BLE001 - the client may be gone
            pass


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
        self.started = False  # a head went to the client
        self.end = StreamEnd(turn)  # for a stream that fails: its typed end

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            for name, value in message.get("headers", ()):
                if name == b"content-type" and value.startswith(b"text/event-stream"):
                    self.stream = True
            if self.status == 200 and not self.stream:
                self.head = message  # its length follows the restored body
                return
            self.started = True
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
            self.started = True
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
            if isinstance(obj, dict):
                if (message := gateway_error(obj)) is not None:
                    return await self._failed(events[:i], message)
                self.end.seen(obj)
        return body

    async def _failed(self, before: list[bytes], message: str) -> bytes:
        """`before`, then the stream's typed end for the gateway's error event (its
        response kept first, as any final one): stream_end.py."""
        obj = self.end.failed(message, self.turn.rid)
        await self._cancelled(obj["response"])
        return b"".join(e + b"\n\n" for e in before) + b"event: " + FAILED.encode() + \
            b"\ndata: " + orjson.dumps(obj) + b"\n\n"
