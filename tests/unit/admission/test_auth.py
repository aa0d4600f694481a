"""Auth: roles from keys, least privilege, loopback-only admin without admin keys, rate limits."""

import pytest
from prometheus_client import CollectorRegistry

from gateway.admission.auth import Auth, Role, presented_key
from gateway.admission.key_limits import KeyLimits
from gateway.config.settings import ConfigError, load_config
from gateway.errors import Forbidden, TooManyRequests, Unauthorized
from gateway.observability.metrics import Metrics
from gateway.servers.pool import ServerPool

REMOTE = ("203.0.113.9", 5000)
LOCAL = ("127.0.0.1", 5000)


def scope(client=REMOTE, **headers: str) -> dict:
    return {"client": client,
            "headers": [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()]}


@pytest.mark.parametrize("headers, expected", [
    ({}, None), ({"authorization": "Bearer k1"}, "k1"), ({"authorization": "bearer k2"}, "k2"),
    ({"x_api_key": "k3"}, "k3"), ({"authorization": "Basic k1"}, None),
    ({"authorization": "Bearer k1", "x_api_key": "other"}, "k1"),
], ids=["none", "bearer", "lowercase-bearer", "x-api-key", "basic-is-not-a-key", "bearer-wins"])
def test_presented_key(headers, expected):
    assert presented_key(scope(**headers)["headers"]) == expected


KEYS = Auth(("inf-key-1", "inf-key-2"), ("adm-key-1",))


@pytest.mark.parametrize("auth, headers, client, needed, outcome", [
    (KEYS, {}, REMOTE, Role.INFERENCE, Unauthorized),
    (KEYS, {"authorization": "Bearer nope"}, REMOTE, Role.INFERENCE, Unauthorized),
    (KEYS, {"authorization": "Bearer inf-key-2"}, REMOTE, Role.INFERENCE, "inference:1"),
    (KEYS, {"authorization": "Bearer adm-key-1"}, REMOTE, Role.INFERENCE, Unauthorized),
    (KEYS, {"authorization": "Bearer inf-key-1"}, REMOTE, Role.ADMIN, Forbidden),
    (KEYS, {"authorization": "Bearer inf-key-1"}, LOCAL, Role.ADMIN, Forbidden),
    (KEYS, {}, LOCAL, Role.ADMIN, Unauthorized),
    (KEYS, {"authorization": "Bearer adm-key-1"}, REMOTE, Role.ADMIN, "admin:0"),
    (KEYS, {}, REMOTE, Role.PUBLIC, None),
    (KEYS, {"authorization": "Bearer nope"}, REMOTE, Role.PUBLIC, None),
    (Auth((), ()), {}, REMOTE, Role.INFERENCE, None),
    (Auth((), ()), {}, REMOTE, Role.ADMIN, Forbidden),
    (Auth((), ()), {}, LOCAL, Role.ADMIN, None),
    (Auth((), ()), {}, ("::1", 1, 0, 0), Role.ADMIN, None),
    (Auth(("inf-key-1",), ()), {"authorization": "Bearer inf-key-1"}, REMOTE, Role.ADMIN,
     Forbidden),
    (Auth(("inf-key-1",), ()), {}, LOCAL, Role.INFERENCE, Unauthorized),
    (Auth((), ("adm-key-1",)), {}, REMOTE, Role.INFERENCE, None),
    (Auth((), ("adm-key-1",)), {}, LOCAL, Role.ADMIN, Unauthorized),
], ids=["no-key", "wrong-key", "inference-key", "admin-key-is-not-inference",
        "inference-key-not-admin", "inference-key-not-admin-even-local",
        "admin-keys-set-local-needs-key", "admin-key", "public-no-key", "public-ignores-bad-key",
        "open-inference", "no-admin-keys-remote-refused", "no-admin-keys-loopback-v4",
        "no-admin-keys-loopback-v6", "inference-key-only-remote-admin",
        "loopback-does-not-skip-inference-keys", "admin-keys-only-inference-open",
        "admin-keys-only-local-needs-key"])
def test_roles(auth, headers, client, needed, outcome):
    if isinstance(outcome, type):
        with pytest.raises(outcome):
            auth.caller(scope(client, **headers), needed)
        return
    caller = auth.caller(scope(client, **headers), needed)
    assert needed in caller.roles
    assert caller.key_id == outcome


def test_owner_is_the_key_and_the_address_without():
    caller = KEYS.caller(scope(authorization="Bearer inf-key-1"), Role.INFERENCE)
    assert caller.owner == "inference:0"
    assert Auth((), ()).caller(scope(), Role.INFERENCE).owner == "anonymous@203.0.113.9"
    assert Auth((), ()).caller(scope(LOCAL), Role.INFERENCE).owner == "anonymous@127.0.0.1"


def test_rate_limit_per_key_with_burst_and_refill():
    now = [1000.0]
    limits = KeyLimits(2, rate=2.0, burst=3, metrics=Metrics(CollectorRegistry(), ServerPool()),
                       clock=lambda: now[0])
    auth = Auth(("key-a", "key-b"), (), limits)
    a, b = scope(authorization="Bearer key-a"), scope(authorization="Bearer key-b")
    for _ in range(3):
        auth.caller(a, Role.INFERENCE)
    with pytest.raises(TooManyRequests) as info:
        auth.caller(a, Role.INFERENCE)
    assert int(info.value.headers["retry-after"]) >= 1
    auth.caller(b, Role.INFERENCE)  # another key has its own bucket
    now[0] += 0.5  # one token back at 2/s
    auth.caller(a, Role.INFERENCE)
    with pytest.raises(TooManyRequests):
        auth.caller(a, Role.INFERENCE)


def test_prompt_tokens_per_minute_per_key():
    now = [100.0]
    limits = KeyLimits(2, tokens_per_minute=600.0, clock=lambda: now[0])
    limits.take_tokens(0, 500)  # a minute's worth at once: 600
    with pytest.raises(TooManyRequests) as info:
        limits.take_tokens(0, 200)  # 100 left; 100 more come in 10 s at 10/s
    assert int(info.value.headers["retry-after"]) == 10
    limits.take_tokens(1, 600)  # another key has its own bucket
    limits.take_tokens(None, 10**9)  # no key: no limit
    now[0] += 10.0
    limits.take_tokens(0, 200)
    with pytest.raises(TooManyRequests) as info:
        limits.take_tokens(0, 601)  # can never fit: refused at once, no Retry-After
    assert "retry-after" not in (info.value.headers or {})


def test_no_token_limit_by_default():
    limits = KeyLimits(1)
    for _ in range(100):
        limits.take_tokens(0, 10**6)


def test_callers_carry_their_configured_tenant(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# team keys\nkey-a team-a\nkey-b\nkey-c team-a\n")
    config = load_config(["--prefill", "http://p:1", "--decode", "http://d:2",
                          "--api-key", "flag-key", "--api-key-file", str(keys),
                          "--admin-api-key", "adm-key"], environ={})
    assert config.api_keys == ("flag-key", "key-a", "key-b", "key-c")
    assert config.api_key_tenants == ("default", "team-a", "default", "team-a")
    auth = Auth(config.api_keys, config.admin_api_keys, tenants=config.api_key_tenants)
    tenant = {k: auth.caller(scope(authorization=f"Bearer {k}"), Role.INFERENCE).tenant
              for k in ("key-a", "key-b", "flag-key")}
    assert tenant == {"key-a": "team-a", "key-b": "default", "flag-key": "default"}
    assert auth.caller(scope(authorization="Bearer adm-key"), Role.ADMIN).tenant == "admin"
    assert Auth((), ()).caller(scope(), Role.INFERENCE).tenant == "anonymous"


@pytest.mark.parametrize("line", ["key-a team a", "key-a team/a", "key-a " + "t" * 65])
def test_a_bad_tenant_name_is_a_config_error(tmp_path, line):
    keys = tmp_path / "keys"
    keys.write_text(line + "\n")
    with pytest.raises(ConfigError, match="KEY TENANT"):
        load_config(["--prefill", "http://p:1", "--decode", "http://d:2",
                     "--api-key-file", str(keys)], environ={})
