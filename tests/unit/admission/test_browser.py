"""BrowserGuard through Auth.caller: Host, Sec-Fetch-Site, Origin and content type of admin
and abort requests; inference and public routes are never checked."""

import pytest

from gateway.admission.auth import Auth, Role
from gateway.admission.browser import host_name, split_host
from gateway.errors import BadRequest, Forbidden

LOCAL = ("127.0.0.1", 5000)
ABORTERS = (Role.ADMIN, Role.INFERENCE)
KEYLESS = Auth((), (), hosts=("127.0.0.1", "gw.internal"))
KEYED = Auth(("inf-1",), ("adm-1",))


def scope(method: str = "POST", client=LOCAL, **headers: str) -> dict:
    return {"method": method, "client": client,
            "headers": [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()]}


@pytest.mark.parametrize("value, name, port", [
    ("localhost:8000", "localhost", 8000), ("LOCALHOST.", "localhost", 80),
    ("[::1]:9", "::1", 9), ("[::1]", "::1", 80), ("127.0.0.1", "127.0.0.1", 80),
    ("a.example:x", "a.example", -1),
], ids=["name-port", "case-and-dot", "v6-port", "v6", "v4-default", "bad-port"])
def test_split_host(value, name, port):
    assert host_name(value) == name
    assert split_host(value, 80) == (name, port)


JSON = {"content_type": "application/json"}


@pytest.mark.parametrize("auth, request_scope, needed, outcome", [
    (KEYLESS, scope(host="localhost:8000", **JSON), Role.ADMIN, None),
    (KEYLESS, scope(host="[::1]:8000", **JSON), Role.ADMIN, None),
    (KEYLESS, scope(host="10.1.2.3:8000", **JSON), Role.ADMIN, None),
    (KEYLESS, scope(host="GW.internal:1", **JSON), Role.ADMIN, None),
    (KEYLESS, scope(**JSON), Role.ADMIN, None),
    (KEYLESS, scope(host="evil.example:8000", **JSON), Role.ADMIN, Forbidden),
    (KEYLESS, scope("GET", host="evil.example:8000"), Role.ADMIN, Forbidden),
    (KEYLESS, scope(host="localhost.evil.example", **JSON), ABORTERS, Forbidden),
    (KEYLESS, scope(client=("203.0.113.9", 1), host="lb.example", **JSON), ABORTERS, None),
    (KEYLESS, scope(host="lb.example", **JSON), Role.INFERENCE, None),
    (KEYED, scope(host="lb.example", authorization="Bearer adm-1", **JSON), Role.ADMIN, None),
    (KEYED, scope(host="lb.example", authorization="Bearer inf-1", **JSON), ABORTERS, None),
    (Auth(("inf-1",), ()), scope(host="lb.example", authorization="Bearer inf-1", **JSON),
     ABORTERS, None),
], ids=["localhost", "v6-literal", "any-ip-literal", "allowed-name", "no-host-not-a-browser",
        "rebinding", "rebinding-read", "rebinding-abort", "remote-anonymous-abort-any-host",
        "inference-any-host", "admin-key-any-host", "inference-key-abort-any-host",
        "keyless-admin-inference-key-abort-any-host"])
def test_host(auth, request_scope, needed, outcome):
    if outcome is None:
        auth.caller(request_scope, needed)
    else:
        with pytest.raises(outcome):
            auth.caller(request_scope, needed)


H = {"host": "127.0.0.1:8000"}


@pytest.mark.parametrize("headers, status", [
    ({**H, "origin": "http://127.0.0.1:8000", **JSON}, None),
    ({"host": "localhost", "origin": "http://localhost:80", **JSON}, None),
    ({"host": "gw.internal", "origin": "https://gw.internal", **JSON}, None),
    ({**H, "sec_fetch_site": "same-origin", **JSON}, None),
    ({**H, "sec_fetch_site": "none", **JSON}, None),
    ({**H, "content_type": "Application/JSON; charset=utf-8"}, None),
    ({**H, "content_length": "0"}, None),
    ({**H, "origin": "http://127.0.0.1:8001", **JSON}, 403),
    ({**H, "origin": "https://127.0.0.1", **JSON}, 403),
    ({**H, "origin": "null", **JSON}, 403),
    ({**H, "origin": "http://127.0.0.1:8000/path", **JSON}, 403),
    ({"origin": "http://127.0.0.1:8000", **JSON}, 403),
    ({**H, "sec_fetch_site": "same-site", **JSON}, 403),
    ({**H, "sec_fetch_site": "cross-site", **JSON}, 403),
    ({**H, "content_type": "text/plain"}, 415),
    ({**H, "content_type": "application/x-www-form-urlencoded", "content_length": "0"}, 415),
    ({**H, "content_length": "12"}, 415),
    ({**H, "transfer_encoding": "chunked"}, 415),
], ids=["same-origin", "default-port", "https-default-port", "fetch-same-origin",
        "fetch-typed-url", "json-with-parameters", "no-body-no-type", "other-port",
        "other-scheme-default-port", "null-origin", "origin-with-path", "origin-without-host", "same-site",
        "cross-site", "text-plain", "form-type-empty-body", "body-without-type",
        "chunked-without-type"])
def test_state_changing_requests(headers, status):
    for needed in (Role.ADMIN, ABORTERS):
        request_scope = scope(**headers)
        if status is None:
            KEYLESS.caller(request_scope, needed)
            KEYLESS.caller(scope("GET", **headers), needed)
            continue
        with pytest.raises(Forbidden if status == 403 else BadRequest) as raised:
            KEYLESS.caller(request_scope, needed)
        assert raised.value.status == status
        KEYLESS.caller(scope("GET", **headers), needed)  # reads change nothing: not checked
        KEYLESS.caller(scope(**headers), Role.INFERENCE)  # nor inference


@pytest.mark.parametrize("name", [b"host", b"origin", b"sec-fetch-site", b"content-type"])
def test_a_header_given_twice_counts_as_neither(name):
    """Proxies disagree on which copy counts; the gateway trusts neither."""
    request_scope = scope(host="127.0.0.1:8000", **JSON)
    request_scope["headers"] += [(name, b"127.0.0.1:8000" if name == b"host" else b"x")] * (
        2 if name in (b"origin", b"sec-fetch-site") else 1)
    with pytest.raises(Forbidden, match="several"):
        KEYLESS.caller(request_scope, Role.ADMIN)
