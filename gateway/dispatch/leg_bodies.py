"""The bodies both PD legs receive: the client's body plus bootstrap fields, rids, DP rank and
priority, encoded once (twice only when the prefill's leg must differ).

Kept apart from the dispatcher (gateway/dispatch/pd.py) because it is pure: a request view, a pair and
rooms in, bytes out; the rules it follows name the SGLang functions they mirror.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from gateway.config.tenants import KEEP, forwarded_priority, set_priority
from gateway.dispatch.attempt import make_rids
from gateway.errors import BadRequest
from gateway.observability.answer_tokens import ask_for_usage
from gateway.request import RequestView
from gateway.servers.pool import Server


@dataclass(slots=True)
class LegBodies:
    payload: bytes  # the decode leg's body (and the prefill's, unless it differs)
    prefill_payload: bytes
    rid: str | list[str]  # the rid field sent
    rids: tuple[str, ...]  # every item's rid on the servers
    unsuffix: bytes | None  # what to cut from answers (a client rid's random suffix)


def leg_bodies(view: RequestView, prefill: Server, decode: Server, rooms: int | list[int],
               rank: int | None, routed: bool, forward_priority: str) -> LegBodies:
    """Both legs' bodies. `rank`: the prefill DP rank both legs name in
    `disagg_prefill_dp_rank` (the decode's `_resolve_prefill_dp_rank` reads it); `routed`:
    the prefill balances by something other than the room, so its leg alone also carries
    `routed_dp_rank` (on the decode leg it would pin the decode's own rank). The priority goes
    to each leg per its server's scheduling (`--forward-priority`, docs/TENANCY.md)."""
    count = view.room_count
    body = dict(view.body)
    if count is None:
        body["bootstrap_host"] = prefill.bootstrap_host
        body["bootstrap_port"] = prefill.bootstrap_port
    else:
        body["bootstrap_host"] = [prefill.bootstrap_host] * count
        body["bootstrap_port"] = [prefill.bootstrap_port] * count
    body["bootstrap_room"] = rooms
    ask_for_usage(view, body)  # an OpenAI stream's usage event (kept from the client)
    rid, rids, unsuffix = make_rids(body.get("rid"), count)
    body["rid"] = rid
    if rank is not None:
        body["disagg_prefill_dp_rank"] = rank
    p_value = d_value = KEEP
    if forward_priority != "off":
        p_value = forwarded_priority(prefill, view.priority, forward_priority)
        set_priority(body, d_value := forwarded_priority(decode, view.priority,
                                                         forward_priority))
    try:
        payload = prefill_payload = orjson.dumps(body)
        if routed or p_value != d_value:
            if routed:
                body["routed_dp_rank"] = rank
            set_priority(body, p_value)
            prefill_payload = orjson.dumps(body)
    except orjson.JSONEncodeError as exc:  # e.g. nesting deeper than orjson writes
        raise BadRequest(f"request body cannot be forwarded: {exc}") from None
    return LegBodies(payload, prefill_payload, rid, rids, unsuffix)
