"""A browser is a stranger: pages on the gateway's own host attack the admin and abort routes.

Without admin keys (the default) the admin API trusts loopback callers, and a browser on the
host is one. Each attack below is sent the way a page makes its browser send it (the headers
a browser adds, the content types a page may use without a preflight), to a real keyless
gateway on loopback; the wire taps show that nothing reached the servers, and the gateway's
own server list that nothing changed. Beside them: the same requests from the gateway's own
pages, from curl-like clients and under an `--allowed-host` name still work.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import orjson
import pytest

from gateway.admission.auth import ADMIN
from gateway.app import ROUTES
from tests.security.conftest import ADMIN_KEY, bearer
from tests.security.rig import Gateway, start_gateway

EVIL = "http://evil.example"
ALLOWED = "gw.internal"
JSON = "application/json"
ABORT_ALL = b'{"abort_all": true}'


@pytest.fixture(scope="module")
def plain(logs, sims) -> Iterator[Gateway]:
    """A gateway on the defaults: no keys of any kind."""
    gateway = start_gateway(logs, "browser-plain", sims)
    yield gateway
    gateway.stop()


@pytest.fixture(scope="module")
def named(logs, sims) -> Iterator[Gateway]:
    gateway = start_gateway(logs, "browser-named", sims, ["--allowed-host", ALLOWED])
    yield gateway
    gateway.stop()


def page(gateway: Gateway, origin: str | None = None, site: str | None = None,
         host: str | None = None, content_type: str | None = JSON) -> dict:
    """The headers a page's request carries (None: left out)."""
    headers = {"host": host, "origin": origin, "sec-fetch-site": site,
               "content-type": content_type, "sec-fetch-mode": "cors" if origin else None}
    return {k: v for k, v in headers.items() if v is not None}


def own(gateway: Gateway, name: str = "127.0.0.1") -> dict:
    """Headers of a request from the gateway's own page, loaded as http://NAME:PORT/."""
    return page(gateway, f"http://{name}:{gateway.port}", "same-origin",
                f"{name}:{gateway.port}")


def drain(gateway: Gateway, sims, headers: dict, content: bytes | None = None,
          path: str = "/admin/servers/drain"):
    body = orjson.dumps({"url": sims.decode.tap.url, "timeout": 5}) if content is None \
        else content
    return gateway.post(path, headers, content=body)


def draining(gateway: Gateway, sims) -> bool:
    return gateway.servers()[sims.decode.tap.url]["draining"]


def refused(response, status: int, words: str) -> None:
    """A refusal in the JSON error shape, naming why."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith(JSON)
    error = response.json()["error"]
    assert error["type"] and words in error["message"], error
    assert "evil" not in response.text, "the attacker's name is echoed"


def no_abort_reached(sims, since: float) -> None:
    assert sims.seen("/abort_request", since) == [], "a refused abort reached a server"


def test_a_cross_site_page_cannot_drain(plain, sims):
    r = drain(plain, sims, page(plain, origin=EVIL))
    refused(r, 403, "cross-origin")
    assert not draining(plain, sims)


def test_a_cross_site_page_cannot_abort_all(plain, sims):
    since = time.monotonic()
    r = plain.post("/abort_request", page(plain, site="cross-site"), content=ABORT_ALL)
    refused(r, 403, "cross-site")
    no_abort_reached(sims, since)


@pytest.mark.parametrize("site", ["same-site", "cross-site", "CROSS-SITE", "bogus"])
def test_only_same_origin_fetches_pass(plain, sims, site):
    """`same-site` too is refused: another port of localhost is another application."""
    refused(drain(plain, sims, page(plain, site=site)), 403, "Sec-Fetch-Site")
    assert not draining(plain, sims)


@pytest.mark.parametrize("origin", [EVIL, "null", "http://127.0.0.1:1", "file://",
                                    "http://localhost", "https://127.0.0.1"])
def test_an_origin_that_is_not_the_gateway_is_refused(plain, sims, origin):
    """Another port, another scheme or name of the same host are other origins."""
    r = drain(plain, sims, page(plain, origin=origin, host=f"127.0.0.1:{plain.port}"))
    refused(r, 403, "cross-origin")


def test_a_text_plain_body_cannot_abort_all(plain, sims):
    """The classic JSON CSRF: a page posts JSON as text/plain, a 'simple' request that no
    preflight guards; old browsers send it without Origin or Sec-Fetch-Site."""
    since = time.monotonic()
    r = plain.post("/abort_request", page(plain, content_type="text/plain;charset=UTF-8"),
                   content=ABORT_ALL)
    refused(r, 415, "application/json")
    no_abort_reached(sims, since)


@pytest.mark.parametrize("content_type", [
    "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None,
    "application/jsonp", "text/json"])
def test_a_form_or_untyped_body_cannot_drain_or_abort(plain, sims, content_type):
    """fetch() may send any body under a form content type without a preflight."""
    since = time.monotonic()
    refused(drain(plain, sims, page(plain, content_type=content_type)), 415, "JSON")
    r = plain.post("/abort_request", page(plain, content_type=content_type), content=ABORT_ALL)
    refused(r, 415, "JSON")
    assert not draining(plain, sims)
    no_abort_reached(sims, since)


def test_a_dns_rebinding_page_cannot_drain_nor_read_the_admin_api(plain, sims):
    """The page's own name resolved to 127.0.0.1: same-origin in the browser's eyes, so only
    the Host it names tells it apart."""
    name = f"rebind.evil.example:{plain.port}"
    rebound = page(plain, f"http://{name}", "same-origin", name)
    refused(drain(plain, sims, rebound), 403, "DNS rebinding")
    since = time.monotonic()
    refused(plain.post("/abort_request", rebound, content=ABORT_ALL), 403, "DNS rebinding")
    no_abort_reached(sims, since)
    for path in ("/admin/servers", "/admin/usage", "/dashboard/data"):
        refused(plain.get(path, {"host": name}), 403, "DNS rebinding")
    assert not draining(plain, sims)


def test_every_state_changing_admin_and_abort_route_refuses_a_cross_site_page(plain, sims):
    """The table of paths, not a list of our own: a new admin route is guarded by its role."""
    since = time.monotonic()
    rows = [(path, method) for path, methods, _, role in ROUTES for method in methods
            if method not in ("GET", "HEAD")
            and (role is ADMIN or (isinstance(role, tuple) and ADMIN in role))]
    assert len(rows) >= 11 and ("/abort_request", "POST") in rows
    for path, method in rows:
        r = plain.session.request(method, path, headers=page(plain, origin=EVIL),
                                  content=ABORT_ALL)
        refused(r, 403, "cross-origin")
    reached = {s.path.split("?")[0] for s in sims.seen(since=since)} & {p for p, _ in rows}
    assert not reached, f"refused requests reached a server: {reached}"
    preflight = plain.session.options("/admin/servers/drain", headers={
        "origin": EVIL, "access-control-request-method": "POST",
        "access-control-request-headers": "content-type"})
    assert not any(k.startswith("access-control-allow") for k in preflight.headers)


def test_the_gateways_own_page_and_curl_still_drain(plain, sims):
    for headers in (own(plain), own(plain, "localhost"), page(plain, site="none"),
                    {"content-type": "application/json; charset=utf-8"}):
        r = drain(plain, sims, headers)
        assert r.status_code == 200 and r.json()["drained"], r.text
        assert draining(plain, sims)
        r = drain(plain, sims, headers, path="/admin/servers/undrain")
        assert r.status_code == 200, r.text
        assert not draining(plain, sims)
    # curl -X POST without a body, and the SDKs' own-request abort
    assert plain.post("/flush_cache").status_code == 200
    r = plain.post("/abort_request", own(plain), json={"rid": "not-in-flight"})
    refused(r, 404, "not-in-flight")


def test_inference_takes_any_host(plain):
    """Behind a load balancer clients name it, not the gateway: only admin and abort routes
    check the Host."""
    r = plain.post("/v1/completions", {"host": "api.example.com"},
                   json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert plain.get("/v1/models", {"host": "api.example.com"}).status_code == 200


def test_an_allowed_host_is_the_gateways_name(named, sims):
    name = f"{ALLOWED}:{named.port}"
    r = drain(named, sims, page(named, f"http://{name}", "same-origin", name))
    assert r.status_code == 200, r.text
    assert draining(named, sims)
    r = drain(named, sims, {"host": name.upper(), "content-type": JSON},
              path="/admin/servers/undrain")
    assert r.status_code == 200, r.text
    assert not draining(named, sims)
    other = f"other.internal:{named.port}"
    refused(drain(named, sims, page(named, f"http://{other}", "same-origin", other)), 403,
            "DNS rebinding")
    assert not draining(named, sims)


def test_with_admin_keys_the_host_is_free_and_pages_still_refused(keyed, sims):
    """An admin key is no address trust: any Host (a load balancer's name) will do, but a
    page still cannot use the key cross-site."""
    assert keyed.get("/admin/servers", {"host": "lb.example", **keyed.admin_headers}) \
        .status_code == 200
    r = keyed.post("/admin/servers/drain", {**page(keyed, origin=EVIL), **bearer(ADMIN_KEY)},
                   content=orjson.dumps({"url": sims.decode.tap.url, "timeout": 5}))
    refused(r, 403, "cross-origin")
    assert not keyed.servers()[sims.decode.tap.url]["draining"]
