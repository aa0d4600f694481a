"""The bodies both PD legs receive: the client's body plus bootstrap fields, rids, DP rank and
priority.

A leg's body is spliced, not re-encoded: the client's fields but the legs' own are one shared
part per request (`shared_part`, kept on the view: every attempt, retry and sample of the
request reuses it): the client's own bytes when they hold none of the legs' fields, else that
rest encoded once; each leg gets only its own small head in front of it (`upstream.base.Body`:
the parts go to the socket one after the other, never joined). So a 30 MiB prompt is held
once as the client sent it, not encoded again per leg and attempt (docs/BENCHMARKS.md,
"Memory under large bodies").

Kept apart from the dispatcher (gateway/dispatch/pd.py) because it is pure: a request view, a
pair and rooms in, bytes out; the rules it follows name the SGLang functions they mirror.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from gateway.config.tenants import KEEP, forwarded_priority
from gateway.dispatch.attempt import make_rids
from gateway.errors import BadRequest
from gateway.observability.answer_tokens import leg_stream_options
from gateway.request import DP_FIELDS, PD_FIELDS, RESPONSES, RequestView
from gateway.servers.pool import Server
from gateway.upstream.base import Body

# What a leg may set: left out of the shared part, written in each leg's own head (a client's
# value of `priority` or `stream_options`, when the gateway keeps it, goes there as well).
LEG_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room", "rid",
              "disagg_prefill_dp_rank", "routed_dp_rank", "priority", "stream_options")
_LEG_SET = frozenset(LEG_FIELDS)
# a body naming any of these (even null) is encoded, not forwarded as sent: the client's bytes
# could hold the name twice, and only the value the gateway read may reach a server
_RAW_UNLESS = _LEG_SET | frozenset(PD_FIELDS + DP_FIELDS)


@dataclass(slots=True)
class LegBodies:
    payload: Body  # the decode leg's body (and the prefill's, unless it differs)
    prefill_payload: Body
    rid: str | list[str]  # the rid field sent
    rids: tuple[str, ...]  # every item's rid on the servers
    unsuffix: bytes | None  # what to cut from answers (a client rid's random suffix)


def shared_part(view: RequestView) -> memoryview:
    """The client's fields but the legs' own, as the members of one JSON object without its
    braces (empty when there are none), made once per view: the client's own bytes when they
    hold none of the legs' fields (the usual request: nothing is encoded at all), else the
    rest of the body encoded."""
    shared = view.encoded
    if shared is None:
        body = view.body
        source = view.source
        if source is not None and source[0] is body and _RAW_UNLESS.isdisjoint(body):
            raw = source[1]  # the bytes orjson parsed into this very body
            shared = memoryview(raw)[raw.index(b"{") + 1:raw.rindex(b"}")]
        else:
            rest = body if _LEG_SET.isdisjoint(body) else {
                k: v for k, v in body.items() if k not in _LEG_SET}
            try:
                encoded = orjson.dumps(rest)
            except orjson.JSONEncodeError as exc:  # e.g. nesting deeper than orjson writes
                raise BadRequest(f"request body cannot be forwarded: {exc}") from None
            shared = memoryview(encoded)[1:-1]
        view.encoded = shared
    return shared


def _leg(own: dict, shared: memoryview, empty: bool) -> Body:
    """`own` fields first, then the shared ones, as one JSON object in three parts."""
    head = orjson.dumps(own)  # small: rooms, rids, hosts (a few KB for a batch of 1024)
    if empty:
        return Body(head)
    return Body(head[:-1] + b",", shared, b"}")


def leg_bodies(view: RequestView, prefill: Server, decode: Server, rooms: int | list[int],
               rank: int | None, routed: bool, forward_priority: str) -> LegBodies:
    """Both legs' bodies. `rank`: the prefill DP rank both legs name in
    `disagg_prefill_dp_rank` (the decode's `_resolve_prefill_dp_rank` reads it); `routed`:
    the prefill balances by something other than the room, so its leg alone also carries
    `routed_dp_rank` (on the decode leg it would pin the decode's own rank). The priority goes
    to each leg per its server's scheduling (`--forward-priority`, docs/TENANCY.md)."""
    shared = shared_part(view)
    count = view.room_count
    body = view.body
    own: dict = {}
    if count is None:
        own["bootstrap_host"] = prefill.bootstrap_host
        own["bootstrap_port"] = prefill.bootstrap_port
    else:
        own["bootstrap_host"] = [prefill.bootstrap_host] * count
        own["bootstrap_port"] = [prefill.bootstrap_port] * count
    own["bootstrap_room"] = rooms
    options = leg_stream_options(view)  # an OpenAI stream's usage event, kept from the client
    if options is not None:
        own["stream_options"] = options
    rid, rids, unsuffix = make_rids(body.get("rid"), count)
    own["rid"] = rid
    if view.endpoint == RESPONSES:  # SGLang's rid there is `request_id` (serving_responses.py)
        own["request_id"] = rid
    if rank is not None:
        own["disagg_prefill_dp_rank"] = rank
    p_value = d_value = KEEP
    if forward_priority != "off":
        p_value = forwarded_priority(prefill, view.priority, forward_priority)
        d_value = forwarded_priority(decode, view.priority, forward_priority)
    _priority(own, body, d_value)
    empty = _LEG_SET.issuperset(body)  # nothing but the legs' own fields: no members shared
    payload = prefill_payload = _leg(own, shared, empty)
    if routed or p_value != d_value:
        if routed:
            own["routed_dp_rank"] = rank
        _priority(own, body, p_value)
        prefill_payload = _leg(own, shared, empty)
    return LegBodies(payload, prefill_payload, rid, rids, unsuffix)


def _priority(own: dict, body: dict, value: int | object | None) -> None:
    """The leg's `priority`: the gateway's, none, or (forwarding off: `KEEP`) the client's."""
    if value is KEEP:
        value = body.get("priority")
    if value is None:
        own.pop("priority", None)
    else:
        own["priority"] = value
