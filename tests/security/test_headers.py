"""Header injection, oversized and malformed request heads.

Raw sockets against the `keyed` gateway (default limits: 100 headers, 32 KiB of URL and
headers, 8 KiB of URL), honest clients beside. A request id the gateway cannot vouch for is
replaced, never echoed or forwarded; a head it cannot parse or over a limit is answered in
the gateway's error shape and the connection is closed.
"""

from __future__ import annotations

import concurrent.futures
import functools
import re

import orjson
import pytest

from gateway.config.settings import GatewayConfig
from tests.security.conftest import UNICODE_KEY
from tests.security.honest import Honest, exchange, status_of

NEW_ID = re.compile(rb"[0-9a-f]{32}")
SAFE = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
BODY = b'{"text": "header attack", "sampling_params": {"max_new_tokens": 2}}'
AUTH = b"authorization: Bearer " + UNICODE_KEY.encode() + b"\r\n"


def request(extra: bytes = b"", path: bytes = b"/generate", body: bytes = BODY,
            auth: bytes = AUTH) -> bytes:
    return (b"POST " + path + b" HTTP/1.1\r\nhost: gateway\r\nconnection: close\r\n"
            b"content-type: application/json\r\n" + auth + extra
            + b"content-length: %d\r\n\r\n" % len(body) + body)


def head_and_body(answer: bytes) -> tuple[dict[bytes, bytes], bytes]:
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")[1:]
    return {k.lower(): v.strip() for k, _, v in (line.partition(b":") for line in lines)}, body


BAD_IDS = [b"x" * 8000, b"\xc3\xa9t\xc3\xa9-\xff", b"a" * 129, b"id with spaces",
           b"id;rm -rf", b"../../etc/passwd", b"<script>alert(1)</script>", b"%0d%0aset-cookie:x",
           b"\"quoted\"", b"id,other-id", b"\xe2\x80\xa8line-separator"]


@pytest.mark.parametrize("auth", [AUTH, b""], ids=["served", "refused-401"])
def test_an_unsafe_request_id_is_replaced_and_never_forwarded(keyed, sims, auth):
    with Honest(keyed):
        for bad in BAD_IDS:
            answer, _ = exchange(keyed.port, request(b"x-request-id: " + bad + b"\r\n",
                                                     auth=auth))
            headers, body = head_and_body(answer)
            assert status_of(answer) == (200 if auth else 401), answer[:300]
            assert NEW_ID.fullmatch(headers[b"x-request-id"]), headers
            assert bad not in answer
            if not auth:
                assert orjson.loads(body)["error"]["request_id"] == \
                    headers[b"x-request-id"].decode()
    for seen in sims.seen("/generate"):
        assert SAFE.fullmatch(seen.header("x-request-id") or ""), seen.headers
        assert all(bad.decode("latin-1") not in v for bad in BAD_IDS for _, v in seen.headers)


def test_a_safe_request_id_is_kept_end_to_end(keyed, sims):
    good = b"client-7.trace:42_a"
    answer, _ = exchange(keyed.port, request(b"x-request-id: " + good + b"\r\n"))
    assert status_of(answer) == 200
    assert head_and_body(answer)[0][b"x-request-id"] == good
    assert any(s.header("x-request-id") == good.decode() for s in sims.seen("/generate"))


LIMITS = GatewayConfig()
FILLER = b"".join(b"x-filler-%03d: v\r\n" % i for i in range(LIMITS.max_header_count))
MALFORMED = {
    "CR inside x-request-id": (request(b"x-request-id: evil\rinjected: 1\r\n"), 400),
    "LF inside x-request-id": (request(b"x-request-id: evil\ninjected: 1\r\n"), 400),
    "bare LF line ends": (request().replace(b"\r\n", b"\n"), 400),
    "NUL in a header value": (request(b"x-request-id: ev\x00il\r\n"), 400),
    "NUL in the URL": (request(path=b"/gene\x00rate"), 400),
    "header line without colon": (request(b"this line is not a header\r\n"), 400),
    "obs-fold continuation": (request(b"x-request-id: evil\r\n  folded: 1\r\n"), 400),
    "space before the colon": (request(b"x-request-id : evil\r\n"), 400),
    "Transfer-Encoding and Content-Length": (request(b"transfer-encoding: chunked\r\n"), 400),
    "two Content-Lengths": (request(b"content-length: 5\r\n"), 400),
    "absurd Content-Length": (request(body=b"").replace(b"length: 0",
                                                        b"length: " + b"9" * 25), 400),
    "HTTP/2 preface": (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 400),
    "control byte in the method": (b"G\x01T /health HTTP/1.1\r\nhost: x\r\n\r\n", 400),
    "over --max-header-count headers": (request(FILLER), 431),
    "over --max-header-bytes": (request(b"x-big: " + b"v" * LIMITS.max_header_bytes + b"\r\n"),
                                431),
    "many small headers over the bytes": (request(b"".join(
        b"x-%02d: %s\r\n" % (i, b"v" * 400) for i in range(90))), 431),
    "URL over 8 KiB": (request(path=b"/generate?" + b"q" * 8200), 414),
    "GET URL over 8 KiB": (b"GET /health?" + b"q" * 8200 + b" HTTP/1.1\r\nhost: x\r\n\r\n",
                           414),
    "headers over the limit on /health": (b"GET /health HTTP/1.1\r\nhost: x\r\n" + FILLER
                                          + b"\r\n", 431),
}


def refused(port: int, name: str) -> None:
    raw, status = MALFORMED[name]
    answer, closed = exchange(port, raw)
    assert status_of(answer) == status, (name, answer[:200])
    headers, body = head_and_body(answer)
    assert closed, f"{name}: the connection stayed open"
    assert headers[b"content-type"] == b"application/json", (name, headers)
    assert orjson.loads(body)["error"]["code"] == str(status)
    assert b"evil" not in answer and b"injected" not in answer


def test_malformed_and_oversized_heads_are_refused_and_closed(keyed, sims):
    assert (LIMITS.max_header_count, LIMITS.max_header_bytes) == (100, 32 * 1024)
    with Honest(keyed), concurrent.futures.ThreadPoolExecutor(8) as pool:
        for _ in range(3):  # every attack three times, eight at once
            list(pool.map(functools.partial(refused, keyed.port), MALFORMED))
    for seen in sims.seen():
        assert all("evil" not in v and "injected" not in k for k, v in seen.headers)


def test_the_limits_are_exact(keyed):
    """Exactly --max-header-count headers pass; one more is refused."""
    base = request().count(b"\r\n") - 2  # request line and blank line are not headers
    fits = b"".join(b"x-f%03d: v\r\n" % i for i in range(LIMITS.max_header_count - base))
    assert status_of(exchange(keyed.port, request(fits))[0]) == 200
    assert status_of(exchange(keyed.port, request(fits + b"x-one-more: v\r\n"))[0]) == 431


def test_a_body_over_the_limit_is_refused_before_it_is_read(keyed):
    raw = request(body=b"").replace(b"content-length: 0",
                                    b"content-length: %d" % (LIMITS.max_body_bytes + 1))
    answer, _ = exchange(keyed.port, raw, timeout=5)
    assert status_of(answer) == 413


def test_upgrades_are_not_switched(keyed):
    for upgrade in (b"websocket", b"h2c"):
        answer, _ = exchange(keyed.port, b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: "
                             b"Upgrade, close\r\nupgrade: " + upgrade + b"\r\nsec-websocket-key: "
                             b"dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n")
        assert status_of(answer) == 200, answer[:200]  # plain HTTP, never 101
