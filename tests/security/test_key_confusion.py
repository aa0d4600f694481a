"""Key confusion: every credential opens exactly its own role's routes, nothing else.

Against the `keyed` gateway (default flags; inference keys from a file, the admin key from the
environment), with honest clients running beside every attack. Which role each route needs is
read from `gateway.app.ROUTES`, so a new route is attacked without editing this file.
"""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from gateway.app import ROUTES, Role
from tests.security.conftest import (
    ADMIN_KEY,
    INFERENCE_KEY_A,
    INFERENCE_KEY_B,
    UNICODE_KEY,
    bearer,
)
from tests.security.honest import Honest

ADMIN_ROUTES = [(m, path) for path, methods, _, role in ROUTES if role is Role.ADMIN
                for m in methods]
INFERENCE_ROUTES = [("POST", "/generate"), ("POST", "/v1/chat/completions"),
                    ("POST", "/v1/completions")] + [
    (m, path) for path, methods, _, role in ROUTES if role is Role.INFERENCE for m in methods]
PUBLIC_ROUTES = [path for path, _, _, role in ROUTES if role is Role.PUBLIC]
BODY = {"text": "key confusion", "sampling_params": {"max_new_tokens": 2},
        "url": "http://127.0.0.1:9", "role": "decode"}


def call(gateway, method: str, path: str, headers=None, params=None, body=None):
    return gateway.session.request(method, path, headers=headers, params=params,
                                   json=None if method == "GET" else body or BODY)


def test_an_inference_key_never_opens_an_admin_route(keyed, sims):
    assert len(ADMIN_ROUTES) >= 10
    with Honest(keyed):
        for method, path in ADMIN_ROUTES:
            for headers in (bearer(INFERENCE_KEY_A), {"x-api-key": INFERENCE_KEY_B},
                            bearer(UNICODE_KEY)):
                r = call(keyed, method, path, headers)
                assert r.status_code == 403, (method, path, r.text)
                assert r.json()["error"]["message"] == "this API key has no admin rights"
            for headers in (None, bearer("sk-wrong"), {"x-api-key": ADMIN_KEY + "x"}):
                assert call(keyed, method, path, headers).status_code == 401, (method, path)
            r = call(keyed, method, path, params={"api_key": ADMIN_KEY, "key": ADMIN_KEY})
            assert r.status_code == 401, f"a key in the query string opened {method} {path}"
    assert set(keyed.servers()) == {s.tap.url for s in sims.both}, "the pool changed"


def test_an_admin_key_never_opens_an_inference_route(keyed):
    with Honest(keyed):
        for method, path in INFERENCE_ROUTES:
            for headers in (bearer(ADMIN_KEY), {"x-api-key": ADMIN_KEY}):
                r = call(keyed, method, path, headers)
                assert r.status_code == 401, (method, path, r.text)
                assert "not an inference key" in r.json()["error"]["message"]


def test_missing_wrong_and_misplaced_keys_are_refused(keyed):
    basic = base64.b64encode(f"user:{INFERENCE_KEY_A}".encode()).decode()
    attempts = [
        {}, bearer("sk-inference-alpha-012345678"), bearer(INFERENCE_KEY_A + "0"),
        {"authorization": f"Basic {basic}"}, {"authorization": f"Bearer{INFERENCE_KEY_A}"},
        {"authorization": INFERENCE_KEY_A}, {"cookie": f"api_key={INFERENCE_KEY_A}"},
        {"x-api-key": ""}, {"authorization": "Bearer"},
    ]
    with Honest(keyed):
        for headers in attempts:
            assert call(keyed, "POST", "/generate", headers).status_code == 401, headers
        for params in ({"api_key": INFERENCE_KEY_A}, {"key": INFERENCE_KEY_A},
                       {"authorization": f"Bearer {INFERENCE_KEY_A}"}):
            assert call(keyed, "POST", "/generate", params=params).status_code == 401, params


def test_duplicate_credentials_are_ambiguous_and_refused(keyed):
    good, wrong = f"Bearer {INFERENCE_KEY_A}", "Bearer sk-wrong"
    with Honest(keyed):
        for headers in ([("authorization", wrong), ("authorization", good)],
                        [("authorization", good), ("authorization", wrong)],
                        [("authorization", good), ("authorization", good)],
                        [("x-api-key", INFERENCE_KEY_A), ("x-api-key", "sk-wrong")],
                        [("authorization", f"Bearer {ADMIN_KEY}"),
                         ("authorization", f"Bearer {ADMIN_KEY}")]):
            for method, path in (("POST", "/generate"), ("GET", "/admin/servers")):
                r = call(keyed, method, path, headers)
                assert r.status_code == 401, (headers, path, r.text)
        # one of each header is not ambiguous: Bearer wins (documented in gateway/admission/auth.py)
        r = call(keyed, "POST", "/generate", [("authorization", good), ("x-api-key", "x")])
        assert r.status_code == 200, r.text


def test_long_binary_and_unicode_keys(keyed):
    with Honest(keyed):
        assert call(keyed, "POST", "/generate", bearer("k" * 20_000)).status_code == 401
        long = call(keyed, "POST", "/generate", bearer("k" * 40_000))
        assert long.status_code == 431  # over --max-header-bytes (32 KiB) before any check
        mojibake = UNICODE_KEY.encode().decode("latin-1").encode()  # UTF-8 read as latin-1
        for raw in (b"Bearer \xff\xfe\xfd", b"Bearer " + mojibake,
                    b"Bearer " + UNICODE_KEY.encode("utf-8")[:-1]):
            assert call(keyed, "POST", "/generate", {"authorization": raw}).status_code == 401
        # the configured non-ASCII key works as its UTF-8 bytes (the honest clients use it)
        assert call(keyed, "POST", "/generate", bearer(UNICODE_KEY)).status_code == 200


def test_probes_and_scrapers_need_no_key_and_ignore_bad_ones(keyed):
    assert {"/health", "/readiness", "/metrics", "/health_generate"} <= set(PUBLIC_ROUTES)
    for path in PUBLIC_ROUTES:
        for headers in (None, bearer("sk-wrong"), [("authorization", "a"), ("authorization", "b")]):
            assert call(keyed, "GET", path, headers).status_code == 200, (path, headers)


def test_keys_never_show_in_ps_or_in_answers(keyed):
    cmdline = Path(f"/proc/{keyed.proc.popen.pid}/cmdline").read_bytes().decode()
    answers = [keyed.get("/metrics").text, keyed.get("/server_info", keyed.headers).text,
               keyed.get("/dashboard/data", keyed.admin_headers).text,
               keyed.get("/admin/servers", keyed.admin_headers).text, keyed.proc.log()]
    for key in (INFERENCE_KEY_A, INFERENCE_KEY_B, UNICODE_KEY, ADMIN_KEY):
        assert key not in cmdline
        assert not any(key in text for text in answers), f"{key} leaked"


@pytest.mark.parametrize("headers, expected", [
    (bearer(ADMIN_KEY), 404), (bearer(INFERENCE_KEY_A), 404), ({}, 401),
    (bearer("sk-wrong"), 401),
], ids=["admin-key", "inference-key", "no-key", "wrong-key"])
def test_abort_takes_an_admin_or_an_inference_key(keyed, headers, expected):
    r = call(keyed, "POST", "/abort_request", headers, body={"rid": "no-such-request"})
    assert r.status_code == expected, r.text
