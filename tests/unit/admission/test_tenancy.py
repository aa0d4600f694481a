"""Tenancy: tenants from keys, classes from the header capped by the tenant, deadlines,
session ids, and the config that sets them up."""

from __future__ import annotations

import asyncio

import pytest

from gateway.admission.tenancy import Tenancy
from gateway.config.settings import ConfigError, load_config
from gateway.config.tenants import (
    BATCH,
    INTERACTIVE,
    KEEP,
    STANDARD,
    TenantSettings,
    forwarded_priority,
    set_priority,
)
from gateway.errors import BadRequest

BASE = ["--prefill", "http://p:1", "--decode", "http://d:2"]
TENANTS = {
    "team-a": TenantSettings(priority="interactive", weight=4),
    "batchers": TenantSettings(priority="batch", max_priority="standard"),
    "*": TenantSettings(max_priority="standard"),
}


def tenancy(**headers) -> Tenancy:
    names = {"priority_header": "x-priority", "deadline_header": "x-request-timeout",
             "session_header": None, **headers}
    return Tenancy(TENANTS, ("team-a", "batchers", "default"), **names)


def classify(t: Tenancy, key: int | None, **headers: str):
    raw = [(name.replace("_", "-").encode(), value.encode()) for name, value in headers.items()]
    return asyncio.run(_classify(t, raw, key))


async def _classify(t, raw, key):
    return t.classify(raw, key)


@pytest.mark.parametrize("key, header, expected", [
    (0, None, INTERACTIVE),  # team-a's own class
    (0, "batch", BATCH),  # a tenant may always ask for less
    (1, None, BATCH),
    (1, "interactive", STANDARD),  # capped at its max_priority
    (1, "  Standard ", STANDARD),  # case and blanks do not matter
    (2, "interactive", STANDARD),  # unlisted tenants get '*'
    (None, "interactive", STANDARD),  # anonymous callers too
    (None, None, STANDARD),
], ids=["own-default", "ask-lower", "batch-default", "capped", "spelling", "star-capped",
        "anonymous-capped", "anonymous-default"])
def test_the_class_is_asked_in_the_header_and_capped_by_the_tenant(key, header, expected):
    headers = {"x_priority": header} if header is not None else {}
    tenant, klass, deadline, session = classify(tenancy(), key, **headers)
    assert klass == expected and deadline is None and session is None
    assert tenant.name == {0: "team-a", 1: "batchers", 2: "default", None: "anonymous"}[key]


def test_tenants_and_weights_come_from_the_configuration():
    t = tenancy()
    assert t.by_key[0].weight == 4 and t.anonymous.weight == 1
    assert set(t.tenants) == {"team-a", "batchers", "default", "anonymous"}


@pytest.mark.parametrize("headers, message", [
    ({"x_priority": "urgent"}, "unknown priority class 'urgent'"),
    ({"x_priority": "x" * 5000}, "unknown priority class"),
    ({"x_request_timeout": "soon"}, "seconds the client waits"),
    ({"x_request_timeout": "0"}, "seconds the client waits"),
    ({"x_request_timeout": "inf"}, "seconds the client waits"),
    ({"x_request_timeout": "1" * 40}, "seconds the client waits"),
    ({"x_session_id": "has space"}, "visible ASCII"),
    ({"x_session_id": "s" * 257}, "visible ASCII"),
], ids=["unknown-class", "huge-class", "not-a-number", "zero", "inf", "oversized-deadline",
        "session-with-space", "session-too-long"])
def test_bad_header_values_are_a_400_naming_the_header(headers, message):
    t = tenancy(session_header="x-session-id")
    with pytest.raises(BadRequest, match=message) as info:
        classify(t, 0, **headers)
    assert info.value.status == 400 and info.value.code == "invalid_header"
    assert len(info.value.message) < 200  # a huge value is not echoed back


def test_deadline_and_session_are_read():
    t = tenancy(session_header="x-session-id")

    async def go():
        loop = asyncio.get_running_loop()
        before = loop.time()
        _, _, deadline, session = t.classify(
            [(b"x-request-timeout", b"2.5"), (b"x-session-id", b"conv-42")], None)
        assert before + 2.4 <= deadline <= loop.time() + 2.6
        assert session == b"conv-42"

    asyncio.run(go())


def test_headers_switched_off_are_not_read():
    t = tenancy(priority_header=None, deadline_header=None)
    _, klass, deadline, _ = classify(t, 1, x_priority="bogus", x_request_timeout="bogus")
    assert klass == BATCH and deadline is None


class Server:
    def __init__(self, scheduling: bool, low_first: bool = False) -> None:
        self.priority_scheduling = scheduling
        self.low_priority_first = low_first


@pytest.mark.parametrize("mode, server, expected", [
    ("auto", Server(False), None),
    ("auto", Server(True), 20),
    ("auto", Server(True, low_first=True), -20),
    ("on", Server(False), 20),
    ("off", Server(True), None),
], ids=["auto-no-scheduling", "auto-scheduling", "auto-low-first", "on", "off"])
def test_the_forwarded_priority_follows_each_servers_scheduling(mode, server, expected):
    assert forwarded_priority(server, INTERACTIVE, mode) == expected


def test_a_clients_own_priority_never_reaches_a_server_unless_forwarding_is_off():
    body = {"priority": 999}
    set_priority(body, None)
    assert "priority" not in body
    body = {"priority": 999}
    set_priority(body, 0)
    assert body["priority"] == 0
    body = {"priority": 999}
    set_priority(body, KEEP)
    assert body["priority"] == 999


def test_the_config_file_takes_tenants_as_yaml(tmp_path):
    path = tmp_path / "gw.yaml"
    path.write_text("tenants:\n  team-a: {priority: interactive, weight: 3}\n"
                    "  '*': {max_priority: standard}\nsession_header: x-session-id\n")
    cfg = load_config(BASE + ["--config", str(path)], environ={})
    assert cfg.tenants["team-a"].weight == 3 and cfg.tenants["*"].ceiling == STANDARD
    assert cfg.session_header == "x-session-id" and cfg.forward_priority == "auto"


@pytest.mark.parametrize("extra, message", [
    (["--tenants", '{"a": {"priority": "urgent"}}'], "tenants.a.priority"),
    (["--tenants", '{"a": {"weight": 0}}'], "tenants.a.weight"),
    (["--tenants", '{"a": {"wieght": 2}}'], "tenants.a.wieght"),
    (["--tenants", '{"a": {"priority": "interactive", "max_priority": "batch"}}'],
     "above max_priority"),
    (["--tenants", '{"bad name": {}}'], "bad tenant name"),
    (["--session-header", "x-priority"], "must differ"),
    (["--deadline-header", "authorization"], "must differ"),
    (["--priority-header", "x priority"], "not a header name"),
    (["--forward-priority", "sometimes"], "forward_priority"),
], ids=["unknown-class", "zero-weight", "unknown-key", "priority-above-max", "bad-name",
        "same-header", "reserved-header", "bad-header", "bad-forward-mode"])
def test_bad_tenancy_settings_are_config_errors(extra, message):
    with pytest.raises(ConfigError, match=message):
        load_config(BASE + extra, environ={})
