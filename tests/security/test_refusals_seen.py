"""What the HTTP protocol refuses shows on /metrics, and a junk flood does not flood the log.

The protocol answers 400/414/431 and closes connections at the head and body deadlines
before the app sees anything (gateway/routes/server_protocol.py): none of it was counted, so
slowloris or a junk flood showed nowhere, while uvicorn wrote "Invalid HTTP request
received." once per junk request (ours refused too). Now `gateway_protocol_refusals_total`
counts each by reason, and the warning goes through once a minute with the count held back.
"""

from __future__ import annotations

import time

from tests.rigs.faults import wait_until
from tests.security.honest import closed_within, connect, exchange, status_of

JUNK = 40
INVALID = "Invalid HTTP request received."


def refusals(gateway, reason: str) -> float:
    return gateway.metrics().total("gateway_protocol_refusals_total", reason=reason)


def test_a_junk_flood_is_counted_and_logged_once(fast):
    before = refusals(fast, "malformed")
    logged = fast.proc.log().count(INVALID)
    for _ in range(JUNK):
        answer, closed = exchange(fast.port, b"NOT HTTP AT ALL\r\n\r\n")
        assert status_of(answer) == 400 and closed
    wait_until(lambda: refusals(fast, "malformed") - before == JUNK, 10,
               "every junk request counted")
    assert fast.proc.log().count(INVALID) - logged <= 1  # before: one line each


def test_too_large_heads_and_deadlines_are_counted_by_reason(fast):
    before = {r: refusals(fast, r) for r in ("headers_too_large", "url_too_long",
                                              "head_timeout", "body_timeout")}
    big = b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"b" * 40_000 + b"\r\n\r\n"
    assert status_of(exchange(fast.port, big)[0]) == 431
    long_url = b"GET /" + b"u" * 10_000 + b" HTTP/1.1\r\nhost: x\r\n\r\n"
    assert status_of(exchange(fast.port, long_url)[0]) == 414
    with connect(fast.port) as half_head, connect(fast.port) as half_body:
        half_head.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n")
        half_body.sendall(b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: "
                          b"application/json\r\ncontent-length: 50\r\n\r\n{")
        started = time.monotonic()
        assert closed_within(half_head, 10) is not None
        assert closed_within(half_body, 10 - (time.monotonic() - started)) is not None
    wanted = {"headers_too_large": 1, "url_too_long": 1, "head_timeout": 1, "body_timeout": 1}
    wait_until(lambda: {r: refusals(fast, r) - before[r] for r in wanted} == wanted, 10,
               "each refusal counted under its reason",
               detail=lambda: {r: refusals(fast, r) - before[r] for r in wanted})
