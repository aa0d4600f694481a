"""The two Anthropic paths as pure ASGI endpoints, beside the OpenAI inference endpoints.

* `POST /v1/messages`: the inference endpoint itself (auth, tenancy, body budget, admission,
  PD dispatch, usage), given this path's parser (`view.parse_messages`) and Anthropic's error
  envelope (`errors.py`) for everything the gateway refuses or fails.
* `POST /v1/messages/count_tokens`: not a PD request; relayed to one usable server of the
  model (decodes first, as `/v1/tokenize` is, the first one in turn), whose SGLang counts the
  prompt its chat template makes (`AnthropicServing.handle_count_tokens`). The gateway does
  not count it itself: its tokenizer renders OpenAI chats, and a count that differed from the
  server's would be wrong the one time it matters (a prompt near the context limit).

Both accept the key as `x-api-key` (what the Anthropic SDK sends) or `Authorization: Bearer`
(`admission/auth.py`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

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
from gateway.upstream.client import upstream_message

COUNT_PATH = "/v1/messages/count_tokens"
TOKENIZE_BYTES_PER_S = 4 << 20  # a server's tokenizer is given a second per 4 MiB of prompt
FIRST_TRY_S = 1.0  # a count takes milliseconds: a server silent this long is likely hung


async def send_anthropic_error(send: Send, err: GatewayError, request_id: str | None) -> None:
    extra = [(k.encode(), v.encode()) for k, v in err.headers.items()]
    if request_id:
        extra.append((b"x-request-id", request_id.encode()))
    await send_bytes(send, err.status, error_bytes(err, request_id), b"application/json", extra)


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
    first_try: float = FIRST_TRY_S  # one server's head start before the next is asked too


class CountTokens:
    """`/v1/messages/count_tokens`, relayed to a usable server of the model: the decodes, then
    the prefills, each list starting one further on per request (so a hung server is first for
    few counts, and no one server takes them all). A server that answers a 5xx or fails to
    connect hands over at once; one silent for `first_try` (1 s, plus a second per 4 MiB of
    body) keeps its request but the next server is asked too (a hedge), and the first answer
    below 500 wins. The whole count ends by `timeout` (--probe-timeout, 10 s; plus the body's
    seconds): then, or with every server failed, 503."""

    def __init__(self, parts: CountParts) -> None:
        self.parts = parts
        self.turn = 0  # rotates the first server asked

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
        await send_bytes(send, status, content, b"application/json",
                         [(b"x-request-id", request_id.encode())])

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
        self.turn += 1
        servers = [w for role in ("decode", "prefill")
                   for w in _rotated(model.usable(role), self.turn)]
        return await self._ask(servers, content)

    async def _ask(self, servers: list, content: bytes) -> tuple[int, bytes]:
        """The first answer below 500 of `servers`, asked in order, hedged as the class says."""
        parts = self.parts
        extra = len(content) / TOKENIZE_BYTES_PER_S
        loop = asyncio.get_running_loop()
        deadline = loop.time() + parts.timeout + extra
        waiting, asked = list(servers), set()
        last = "no usable server"
        try:
            while waiting or asked:
                if waiting:  # the first, or the one after a failure or a silent head start
                    asked.add(asyncio.create_task(self._post(waiting.pop(0).url, content,
                                                             deadline - loop.time())))
                left = deadline - loop.time()
                if left <= 0:
                    last = f"no answer in {parts.timeout + extra:.1f} s"
                    break
                done, asked = await asyncio.wait(
                    asked, timeout=min(left, parts.first_try + extra) if waiting else left,
                    return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    answer = task.result()
                    if isinstance(answer, tuple):
                        return answer
                    last = answer
        finally:  # the slower servers' requests end with the count
            for task in asked:
                task.cancel()
            await asyncio.gather(*asked, return_exceptions=True)
        raise ServiceUnavailable(f"no server could count the tokens: {last}",
                                 headers={"retry-after": "1"})

    async def _post(self, url: str, content: bytes, timeout: float) -> tuple[int, bytes] | str:
        """One server's answer (status, body) if below 500, else why not."""
        try:
            response = await self.parts.client.post(
                url + COUNT_PATH, content=content, timeout=max(timeout, 0.001),
                headers={"content-type": "application/json"})
        except httpx.HTTPError as exc:
            return f"{url}: {type(exc).__name__}"
        if response.status_code < 500:
            return response.status_code, response.content
        return f"{url} answered {response.status_code}: {upstream_message(response.content)}"


def _rotated(servers: list, turn: int) -> list:
    """`servers` starting at the `turn`-th (modulo their number)."""
    k = turn % len(servers) if servers else 0
    return servers[k:] + servers[:k]


def messages_endpoints(inference: InferenceParts, gateway) -> dict:
    """The Anthropic paths and their endpoints, for the app's table of hot paths."""
    c = gateway.config
    count = CountParts(gateway.auth, gateway.models, gateway.client, c.probe_timeout,
                       c.max_body_bytes, inference.bodies)
    return {"/v1/messages": MessagesEndpoint(inference), COUNT_PATH: CountTokens(count)}
