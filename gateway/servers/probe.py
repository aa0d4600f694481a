"""Startup facts about a server: its PD role, bootstrap port, model and DP size.

Read from `/server_info` (deprecated alias `/get_server_info` on older SGLang). A server
whose `disaggregation_mode` contradicts the role it was given is a configuration error:
sending it the other half of a PD request would fail or, worse, answer empty text.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass

import httpx

DEFAULT_BOOTSTRAP_PORT = 8998


class RoleMismatch(Exception):
    """The server says it runs in another disaggregation mode (`mode`) than its given role."""

    def __init__(self, message: str, mode: str) -> None:
        super().__init__(message)
        self.mode = mode


FOLLOW_ROOM = "follow_bootstrap_room"


@dataclass(frozen=True)
class ServerFacts:
    mode: str | None
    bootstrap_port: int | None
    model: str | None
    dp_size: int  # DP ranks (schedulers) in the server: dp_size x attn_dp_size
    kv_events: dict | None = None
    load_balance_method: str = FOLLOW_ROOM  # how the server picks a DP rank
    context_length: int | None = None
    # prompts must be shorter: the scheduler's `max_req_input_len` (tp_worker: the context or
    # the KV pool, less 1, less 5), checked by `validate_input_length` on every server
    max_input_length: int | None = None
    priority_scheduling: bool = False  # --enable-priority-scheduling (gateway/config/tenants.py)
    low_priority_first: bool = False  # --schedule-low-priority-values-first


def dp_ranks_of(info: dict) -> int:
    """DP ranks of a server: `dp_size * attn_dp_size` (runtime_context.num_dp_ranks_of in
    0.5.23, where `--dp-size N --enable-dp-attention` reports dp_size 1, attn_dp_size N);
    older servers report only dp_size."""
    try:
        dp = int(info.get("dp_size") or 1)
        attn = int(info.get("attn_dp_size") or 1)
    except (TypeError, ValueError):
        return 1
    return max(1, dp) * max(1, attn)


def balance_method_of(info: dict, mode: str | None) -> str:
    """The resolved load-balance method; "auto" (or an older server that does not say)
    resolves as `arg_groups/serving_hook.py:handle_load_balance_method` does: rooms decide
    on a PD prefill, round robin elsewhere."""
    method = info.get("load_balance_method")
    if isinstance(method, str) and method not in ("", "auto"):
        return method
    return FOLLOW_ROOM if mode in ("prefill", None) else "round_robin"


async def fetch_server_info(client: httpx.AsyncClient, url: str, timeout: float) -> dict:
    last: Exception | None = None
    for path in ("/server_info", "/get_server_info"):
        try:
            async with asyncio.timeout(timeout):
                response = await client.get(url + path)
        except (httpx.HTTPError, TimeoutError) as exc:
            last = exc
            continue
        if response.status_code == 200:
            try:
                data = response.json()
            except ValueError:
                data = None
            if isinstance(data, dict):
                return data
            last = RuntimeError(f"{url}{path} did not answer a JSON object")
            continue
        last = RuntimeError(f"{url}{path} answered {response.status_code}")
    raise ConnectionError(f"cannot read server info from {url}: {last}")


def live_mode(info: dict) -> str | None:
    """The role a server runs now. SGLang's top-level `disaggregation_mode` is its launch
    configuration, which a runtime role switch (`POST /pd_role_switch`) leaves as it was; its
    schedulers' internal state says the live role (InternalStateReader._add_disaggregation,
    re-derived on every flip), so that one wins where a server reports it."""
    states = info.get("internal_states")
    if isinstance(states, list) and states and isinstance(states[0], dict):
        mode = states[0].get("disaggregation_mode")
        if isinstance(mode, str):
            return mode
    return info.get("disaggregation_mode")


def facts_from_info(info: dict, url: str, role: str) -> ServerFacts:
    mode = live_mode(info)
    if mode is not None and mode != role:
        raise RoleMismatch(
            f"{url} was given as a {role} server but runs with "
            f"--disaggregation-mode {mode}; fix the --{role} list", mode)
    port = info.get("disaggregation_bootstrap_port")
    model = info.get("served_model_name") or info.get("model_path")
    return ServerFacts(
        mode=mode,
        bootstrap_port=int(port) if port is not None else (
            DEFAULT_BOOTSTRAP_PORT if role == "prefill" else None),
        model=model if isinstance(model, str) else None,
        dp_size=dp_ranks_of(info),
        kv_events=info.get("kv_events") if isinstance(info.get("kv_events"), dict) else None,
        load_balance_method=balance_method_of(info, mode),
        context_length=_positive_int(info.get("context_length")),
        max_input_length=_positive_int(info.get("max_req_input_len")),
        priority_scheduling=info.get("enable_priority_scheduling") is True,
        low_priority_first=info.get("schedule_low_priority_values_first") is True,
    )


def _positive_int(value: object) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


async def probe(client: httpx.AsyncClient, url: str, role: str, timeout: float) -> ServerFacts:
    facts = facts_from_info(await fetch_server_info(client, url, timeout), url, role)
    if facts.context_length is None:  # 0.5.23 reports it in /v1/models, not /server_info
        facts = dataclasses.replace(facts, context_length=await _max_model_len(client, url,
                                                                               timeout))
    return facts


async def _max_model_len(client: httpx.AsyncClient, url: str, timeout: float) -> int | None:
    try:
        async with asyncio.timeout(timeout):
            response = await client.get(url + "/v1/models")
        cards = response.json().get("data") if response.status_code == 200 else None
    except (httpx.HTTPError, TimeoutError, ValueError, AttributeError):
        return None
    if isinstance(cards, list) and cards and isinstance(cards[0], dict):
        return _positive_int(cards[0].get("max_model_len"))
    return None
