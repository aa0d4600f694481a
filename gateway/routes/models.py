"""`/v1/models`, `/v1/models/{model}` and `/model_info`, for every model behind the gateway.

`GET /v1/models` lists every model with a registered server once, in OpenAI's list shape
(`{"object": "list", "data": [card, ...]}`): per model, the cards one of its servers reports
(its base model, named as the gateway names it, with `max_model_len`, and its LoRA adapters,
`parent` the model), or, while none of its servers answers, a card made from what the probe
learned (name, context length). Then one card per alias: `id` the alias, `root` the model it
stands for, that model's `max_model_len`. With one model and no aliases this is exactly its
server's own answer (the same cards).

`GET /v1/models/{model}` is one card of that list (aliases too), else 404 `model_not_found`.
`GET /model_info?model=NAME` answers for NAME's model (an alias resolves; without `model`, the
model of a request that names none). All are computed at most once per `--info-cache-ttl`.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.errors import ModelNotFound
from gateway.redact import redact
from gateway.routes.fleet import Fleet, get_from_any
from gateway.scheduling.models import Model

LIST = "/v1/models"


async def list_models(request: Request, fleet: Fleet) -> Response:
    status, body = await fleet.caches.get(LIST, lambda: collect_models(fleet)).get()
    return Response(body, status_code=status, media_type="application/json")


async def model_card(request: Request, fleet: Fleet) -> Response:
    name = request.path_params["model"]
    status, body = await fleet.caches.get(LIST, lambda: collect_models(fleet)).get()
    if status != 200:
        return Response(body, status_code=status, media_type="application/json")
    for card in orjson.loads(body)["data"]:
        if card.get("id") == name:
            return JSONResponse(card)
    raise ModelNotFound(name, fleet.models.names())


async def model_info(request: Request, fleet: Fleet) -> Response:
    models = fleet.models
    model, _ = models.lookup(request.query_params.get("model"))
    key = "/model_info" if models.open else f"/model_info {model.name}"
    # open: the one model of the moment (it can change); checked: a model object stays
    cache = fleet.caches.get(
        key, lambda: get_from_any(fleet, "/model_info", models.only or model))
    status, body = await cache.get()
    return Response(body, status_code=status, media_type="application/json")


async def collect_models(fleet: Fleet) -> tuple[int, bytes]:
    """The model list (the cached computation)."""
    models = fleet.models
    listed = models.listed()
    found = await asyncio.gather(*(cards_of(fleet, model) for model in listed))
    data = [card for cards in found for card in cards]
    bases = {model.name: cards[0] for model, cards in zip(listed, found, strict=True)}
    for alias, target in sorted(models.aliases.items()):
        base = bases.get(target)
        if base is not None and alias not in models.known:  # a model's own name wins
            data.append({**base, "id": alias, "root": target, "parent": None})
    return 200, orjson.dumps({"object": "list", "data": data})


async def cards_of(fleet: Fleet, model: Model) -> list[dict]:
    """The model's base card first, then its adapters: from the first server that answers,
    else from the probe's facts."""
    for server in model.usable("decode") + model.usable("prefill"):
        try:
            response = await fleet.client.get(server.url + LIST, timeout=fleet.probe_timeout)
            cards = response.json().get("data") if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            continue
        if not isinstance(cards, list) or not all(isinstance(c, dict) for c in cards):
            continue
        base = next((c for c in cards if c.get("parent") is None), None)
        if base is None:
            continue
        served = base.get("id")
        adapters = [{**c, "parent": model.name} for c in cards
                    if c is not base and c.get("parent") == served]
        return [redact({**base, "id": model.name}), *(redact(c) for c in adapters)]
    return [{"id": model.name, "object": "model", "created": int(time.time()),
             "owned_by": "sglang", "root": model.name, "parent": None,
             "max_model_len": model.context_length()}]
