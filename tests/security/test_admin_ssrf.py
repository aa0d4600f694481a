"""SSRF through the admin API: nobody but an admin can make the gateway call a URL, and even an
admin can add only an SGLang server of the right role; honest traffic never goes anywhere else.

Strangers: every attempt without the admin key is refused before the body is read, so the
foreign server is never contacted. The admin (a stolen key): arbitrary URLs are refused, and
those that answer are only probed (`GET /server_info`), never sent a generation. The loopback
rule for gateways without admin keys is attacked through ASGI scopes in test_rules.py.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.procs import free_port
from tests.security.conftest import ADMIN_KEY, INFERENCE_KEY_A, bearer
from tests.security.foreign import Foreign
from tests.security.honest import Honest
from tests.security.rig import start_gateway

SERVERS = "/admin/servers"
STRANGERS = [None, bearer("sk-wrong"), bearer(INFERENCE_KEY_A), {"x-api-key": INFERENCE_KEY_A},
             [("authorization", f"Bearer {ADMIN_KEY}"), ("authorization", "Bearer x")]]


def add(gateway, url, role="prefill", headers=None, **extra):
    return gateway.post(SERVERS, headers, json={"url": url, "role": role, **extra})


def refused_for_strangers(gateway, target: Foreign) -> None:
    for headers in STRANGERS:
        for role in ("prefill", "decode"):
            r = add(gateway, target.url, role, headers)
            assert r.status_code in (401, 403), (headers, r.status_code, r.text)
        r = gateway.post(SERVERS, headers, params={"api_key": ADMIN_KEY},
                         json={"url": target.url, "role": "decode"})
        assert r.status_code in (401, 403)
    assert target.hits == [], "a refused caller made the gateway contact a URL"


def test_strangers_cannot_make_the_gateway_call_a_url(keyed, sims):
    with Foreign() as target, Honest(keyed):
        refused_for_strangers(keyed, target)
        for headers in STRANGERS:  # nor remove or drain the real servers
            for path, method in ((SERVERS, "DELETE"), (SERVERS + "/drain", "POST")):
                r = keyed.session.request(method, path, headers=headers,
                                          json={"url": sims.decode.tap.url, "timeout": 0})
                assert r.status_code in (401, 403)
    assert set(keyed.servers()) == {s.tap.url for s in sims.both}


def bad_urls(gateway, foreign: dict[str, Foreign]) -> list[tuple[object, str]]:
    closed = f"http://127.0.0.1:{free_port()}"
    ok = foreign["json"].url
    host_port = ok.split("://", 1)[1]
    return [
        (closed, "did not answer"),
        (f"http://[::1]:{free_port()}", "did not answer"),
        (foreign["json"].url, "not an SGLang prefill server"),
        (foreign["html"].url, "did not answer"),
        (foreign["redirect"].url, "did not answer"),
        (foreign["decode"].url, "not an SGLang prefill server"),
        (foreign["v6"].url, "not an SGLang prefill server"),
        (gateway.url, "did not answer"),  # its /server_info wants a key; and says no mode
        (f"http://user:pw@{host_port}", "nothing else"),
        (f"http://:pw@{host_port}", "nothing else"),
        (f"http://@{host_port}", "nothing else"),
        (f"{ok}/v1", "nothing else"),
        (f"{ok}/?x=1", "nothing else"),
        (f"{ok}/?", "nothing else"),
        (f"{ok}#frag", "nothing else"),
        (f"{ok}\\@169.254.169.254", "nothing else"),
        (f"{ok}\r\nx-injected: 1", "nothing else"),
        ("file:///etc/passwd", "nothing else"),
        (f"gopher://{host_port}/_POST%20/generate", "nothing else"),
        (f"ftp://{host_port}", "nothing else"),
        ("data:application/json,{}", "nothing else"),
        (f"http://{host_port.split(':')[0]}:99999", "bad server URL"),
        ([ok], "nothing else"),
        (None, "nothing else"),
    ]


@pytest.fixture
def foreign():
    with (Foreign() as json_, Foreign(b"<html><body>hello</body></html>", "text/html") as html,
          Foreign(b'{"disaggregation_mode": "decode", "disaggregation_bootstrap_port": 1}')
          as decode, Foreign(host="::1") as v6, Foreign() as target):
        with Foreign(b"", status=302, location=target.url + "/server_info") as redirect:
            yield {"json": json_, "html": html, "decode": decode, "v6": v6,
                   "redirect": redirect, "target": target}


def test_an_admin_can_add_only_sglang_servers_of_the_right_role(keyed, sims, foreign):
    admin = keyed.admin_headers
    before = {s.path for s in sims.seen()}
    with Honest(keyed, minimum=8):
        for url, why in bad_urls(keyed, foreign):
            r = add(keyed, url, "prefill", admin)
            assert r.status_code == 400, (url, r.status_code, r.text)
            assert why in r.json()["error"]["message"], (url, r.text)
        for url in (sims.decode.tap.url, sims.prefill.tap.url + "/"):  # already there
            assert add(keyed, url, "decode", admin).status_code == 409
        assert add(keyed, foreign["json"].url, "sideways", admin).status_code == 400
        assert add(keyed, foreign["json"].url, "decode", admin,
                   bootstrap_port="8998").status_code == 400
    assert set(keyed.servers()) == {s.tap.url for s in sims.both}, "a foreign URL joined"
    for name, server in foreign.items():
        assert server.posts() == [], f"the {name} server was sent {server.posts()}"
        assert all(path in ("/server_info", "/get_server_info") for _, path in server.hits)
    assert foreign["target"].hits == [], "the probe followed a redirect"
    assert {s.path for s in sims.seen()} >= before  # the real servers kept serving


def test_a_foreign_server_answering_like_sglang_is_still_only_probed(keyed, foreign):
    """The `{}` server looks like an SGLang server without a PD mode: refused for both roles
    (it would otherwise join as a prefill with bootstrap port 8998 and get real traffic)."""
    with Honest(keyed):
        for role in ("prefill", "decode"):
            r = add(keyed, foreign["json"].url, role, keyed.admin_headers)
            assert r.status_code == 400, r.text
    assert foreign["json"].url not in keyed.servers()
    assert foreign["json"].posts() == []


def test_the_same_server_added_at_once_is_added_once(logs, sims):
    """Three admins add the same URL at once: each add probes it before it joins the pool,
    so all three pass the "already registered" check. One is added (201); the others were
    a 500 and a traceback (the pool's refusal surfaced as an internal error), now 409. With
    `--workers`, adds through different workers: tests/integration/test_workers_admin_add.py."""
    gateway = start_gateway(logs, "adds", sims)
    try:
        r = gateway.session.request("DELETE", SERVERS, json={"url": sims.decode.tap.url})
        assert r.status_code == 200, r.text
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda _: add(gateway, sims.decode.tap.url, "decode"),
                                    range(3)))
        codes = sorted(r.status_code for r in answers)
        assert codes == [201, 409, 409], [r.text for r in answers]
        assert set(gateway.servers()) == {s.tap.url for s in sims.both}
    finally:
        gateway.stop()
