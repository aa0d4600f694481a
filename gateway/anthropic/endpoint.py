"""The two Anthropic paths as pure ASGI endpoints, beside the OpenAI inference endpoints.

* `POST /v1/messages`: the inference endpoint itself (auth, tenancy, body budget, admission,
  PD dispatch, usage), given this path's parser (`view.parse_messages`) and Anthropic's error
  envelope (`errors.py`) for everything the gateway refuses or fails.
* `POST /v1/messages/count_tokens`: not a PD request; relayed to one usable server of the
  model, asked in turn as the context check asks `/v1/tokenize` (`tokens/ask_in_turn.py`),
  whose SGLang counts the prompt its chat template makes
  (`AnthropicServing.handle_count_tokens`). The gateway does
  not count it itself: its tokenizer renders OpenAI chats, and a count that differed from the
  server's would be wrong the one time it matters (a prompt near the context limit).

Both accept the key as `x-api-key` (what the Anthropic SDK sends) or `Authorization: Bearer`
(`admission/auth.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import httpx
import orjson
from starlette.types import Receive, Scope, Send

from gateway.admission.auth import INFERENCE, Auth
from gateway.admission.body_budget import BodyBudget, BodyLease
from gateway.anthropic.errors import error_bytes
from gateway.anthropic.view import check_messages, parse_messages
from gateway.errors import BadRequest, GatewayError, ServiceUnavailable
from gateway.request import MESSAGES, json_object
from gateway.routes.asgi import ClientGone, read_body, send_bytes
from gateway.routes.inference import InferenceEndpoint, InferenceParts, request_id_of
from gateway.scheduling.models import Models
from gateway.servers.pool import Server
from gateway.tokens.ask_in_turn import HEAD_START_S, InTurn, NoAnswer
from gateway.upstream.client import upstream_message

COUNT_PATH = "/v1/messages/count_tokens"


async def send_anthropic_error(send: Send, err: GatewayError, request_id: str | None) -> None:
    extra = [(k.encode(), v.encode()) for k, v in err.headers.items()]
    if request_id:
        extra += id_headers(request_id)
    await send_bytes(send, err.status, error_bytes(err, request_id), b"application/json", extra)


def id_headers(request_id: str) -> list[tuple[bytes, bytes]]:
    """The request's id as both headers: ours (`x-request-id`) and Anthropic's (`request-id`,
    what its SDK exposes as `request_id` on answers and errors)."""
    value = request_id.encode()
    return [(b"x-request-id", value), (b"request-id", value)]


class MessagesEndpoint(InferenceEndpoint):
    """`/v1/messages`: the inference endpoint with this path's parser and error envelope."""

    def __init__(self, parts: InferenceParts) -> None:
        super().__init__(parts, MESSAGES, parse_messages)

    async def send_error(self, send: Send, err: GatewayError, request_id: str) -> None:
        await send_anthropic_error(send, err, request_id)


@dataclass(frozen=True, slots=True)
class CountParts:
    auth: Auth
    models: Models
    client: httpx.AsyncClient  # the control client (probes, health, relays)
    timeout: float  # for the whole count, plus a second per 4 MiB of body
    max_body_bytes: int
    bodies: BodyBudget  # the in-flight body budget, as the inference endpoints charge it
    first_try: float = HEAD_START_S  # one server's head start before the next is asked too


class CountTokens:
    """`/v1/messages/count_tokens`, relayed to a usable server of the model, asked in turn
    (`InTurn`: decodes, then prefills, rotated per request; a 5xx or no connection hands over
    at once, `first_try` of silence asks the next too) and the first answer below 500 wins.
    The whole count ends by `timeout` (--probe-timeout, 10 s; plus a second per 4 MiB of
    body): then, or with every server failed, 503."""

    def __init__(self, parts: CountParts) -> None:
        self.parts = parts
        self.in_turn = InTurn(parts.first_try)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = request_id_of(scope)
        lease = self.parts.bodies.lease()
        try:
            status, content = await self._count(scope, receive, lease)
        except GatewayError as err:
            await send_anthropic_error(send, err, request_id)
            return
        except ClientGone:
            return
        finally:
            lease.release()
        await send_bytes(send, status, content, b"application/json", id_headers(request_id))

    async def _count(self, scope: Scope, receive: Receive,
                     lease: BodyLease) -> tuple[int, bytes]:
        parts = self.parts
        parts.auth.caller(scope, INFERENCE)
        raw = await read_body(scope, receive, parts.max_body_bytes, buffer=True, lease=lease)
        body = json_object(raw)
        name = body.get("model")
        if not isinstance(name, str) or not name:
            raise BadRequest("'model' is required and must be a non-empty string")
        check_messages(body)
        model, upstream = parts.models.lookup(name)
        content = bytes(raw) if upstream is None else orjson.dumps({**body, "model": upstream})
        try:
            return await self.in_turn.ask(self.in_turn.servers(model), partial(self._post, content),
                                          parts.timeout, len(content))
        except NoAnswer as exc:
            raise ServiceUnavailable(f"no server could count the tokens: {exc}",
                                     headers={"retry-after": "1"}) from None

    async def _post(self, content: bytes, server: Server) -> tuple[int, bytes]:
        """One server's answer (status, body) if below 500, else NoAnswer saying why. (The
        count's deadline bounds it: `InTurn.ask` cancels it then.)"""
        url = server.url
        try:
            response = await self.parts.client.post(
                url + COUNT_PATH, content=content, timeout=None,
                headers={"content-type": "application/json"})
        except httpx.HTTPError as exc:
            raise NoAnswer(f"{url}: {type(exc).__name__}") from None
        if response.status_code < 500:
            return response.status_code, response.content
        raise NoAnswer(f"{url} answered {response.status_code}: "
                       f"{upstream_message(response.content)}")


def messages_endpoints(inference: InferenceParts, gateway) -> dict:
    """The Anthropic paths and their endpoints, for the app's table of hot paths."""
    c = gateway.config
    count = CountParts(gateway.auth, gateway.models, gateway.client, c.probe_timeout,
                       c.max_body_bytes, inference.bodies)
    return {"/v1/messages": MessagesEndpoint(inference), COUNT_PATH: CountTokens(count)}
