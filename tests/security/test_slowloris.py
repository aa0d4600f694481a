"""Slowloris on the request side and connection floods.

The `fast` gateway runs with `--head-timeout 1 --body-timeout 1` so that a deadline shows in a
second; the defaults (10 s for the head, 60 s for the body) are checked as values, and the
10 s head deadline is shown live on the `keyed` gateway by a connection opened when it started
(conftest.IdleProbe), so this suite never waits 10 s of its own for it.
"""

from __future__ import annotations

import re
import selectors
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from gateway.config.settings import GatewayConfig
from gateway.routes.server_protocol import ServerLimits
from tests.security.honest import Honest, Stream, closed_within, connect, exchange, status_of
from tests.security.rig import start_gateway, wait_for

HEAD, BODY = 1.0, 1.0  # the fast gateway's deadlines
SLACK = 2.5  # a loaded 2-core machine: the close may come this much late, never early


def trickle(sock: socket.socket, data: bytes, interval: float, stop: threading.Event) -> None:
    """Send `data` one byte per `interval` until it is sent, the peer closes, or `stop`."""
    for byte in data:
        if stop.wait(interval):
            return
        try:
            sock.send(bytes([byte]))
        except OSError:
            return


def watch_closes(socks: list[socket.socket], timeout: float,
                 since: float) -> dict[socket.socket, float]:
    """Seconds after `since` until the server closed each socket (absent: still open)."""
    started = time.monotonic()
    closed: dict[socket.socket, float] = {}
    with selectors.DefaultSelector() as selector:
        for sock in socks:
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ)
        while len(closed) < len(socks) and time.monotonic() - started < timeout:
            for key, _ in selector.select(0.1):
                try:
                    data = key.fileobj.recv(65536)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if not data:
                    closed[key.fileobj] = time.monotonic() - since
                    selector.unregister(key.fileobj)
    return closed


HEAD_BYTES = b"POST /generate HTTP/1.1\r\nhost: slow\r\ncontent-type: application/json\r\n" \
             b"content-length: 64\r\n" + b"x-pad: " + b"p" * 200 + b"\r\n\r\n"


def test_a_head_sent_byte_by_byte_is_cut_at_the_head_deadline(fast):
    stop = threading.Event()
    with Honest(fast), connect(fast.port) as sock:
        opened = time.monotonic()
        threading.Thread(target=trickle, args=(sock, HEAD_BYTES, 0.05, stop), daemon=True).start()
        took = closed_within(sock, HEAD + SLACK + 2)
        stop.set()
        assert took is not None, "a trickled head kept its connection open"
        assert HEAD - 0.1 <= time.monotonic() - opened <= HEAD + SLACK


def test_a_body_sent_byte_by_byte_is_cut_at_the_body_deadline(fast):
    stop = threading.Event()
    with Honest(fast), connect(fast.port) as sock:
        sock.sendall(HEAD_BYTES)
        sent = time.monotonic()
        threading.Thread(target=trickle, args=(sock, b"{" * 64, 0.05, stop), daemon=True).start()
        took = closed_within(sock, BODY + SLACK + 2)
        stop.set()
        assert took is not None, "a trickled body kept its connection open"
        assert BODY - 0.1 <= time.monotonic() - sent <= BODY + SLACK


def open_many(port: int, count: int) -> dict[socket.socket, float]:
    """`count` connections, each with when its connect returned: the server's deadline for it
    starts at its accept, never before (opening 300 takes a few tenths of a second)."""
    opened = {}
    for _ in range(count):
        sock = connect(port)
        opened[sock] = time.monotonic()
    return opened


@pytest.mark.parametrize("count, trickling", [(300, False), (120, True)],
                         ids=["300-idle", "120-trickling"])
def test_a_connection_flood_is_shed_and_honest_requests_go_on(fast, count, trickling):
    stop = threading.Event()
    with Honest(fast, loops=4, minimum=20) as honest:
        opened = open_many(fast.port, count)
        socks = list(opened)
        if trickling:
            for sock in socks:
                threading.Thread(target=trickle, args=(sock, HEAD_BYTES, 0.2, stop),
                                 daemon=True).start()
        during = honest.count()
        closed = watch_closes(socks, HEAD + SLACK + 3, since=0.0)  # monotonic times
        stop.set()
        assert len(closed) == count, f"{count - len(closed)} flood connections still open"
        lived = [closed[sock] - opened[sock] for sock in socks]  # each from its own connect
        assert HEAD - 0.1 <= min(lived) and max(lived) <= HEAD + SLACK + 3
        assert honest.count() > during, "no honest request completed during the flood"
        for sock in socks:
            sock.close()


def test_the_default_deadlines_are_finite_and_applied(keyed):
    config = GatewayConfig()
    assert (config.head_timeout, config.body_timeout, config.send_timeout) == (10.0, 60.0, 30.0)
    assert ServerLimits() == ServerLimits(head_timeout=10.0, body_timeout=60.0,
                                          send_timeout=30.0)
    probe = keyed.idle_probe  # opened right after the keyed gateway started
    probe.join(max(0.0, probe.opened + 10 + SLACK + 1 - time.monotonic()))
    assert probe.closed_after is not None, "the default head deadline never closed it"
    assert 10 - 0.1 <= probe.closed_after <= 10 + SLACK
    served = re.search(r"at most (\d+) client connections", keyed.proc.log())
    assert served and 64 <= int(served.group(1)) < 1_000_000, keyed.proc.log()[-500:]


@pytest.fixture(scope="module")
def limited(logs, sims) -> Iterator:
    gateway = start_gateway(logs, "limited", sims, ["--max-client-connections", "8"])
    yield gateway
    gateway.stop()


HEALTH = b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"


def test_excess_connections_get_503_at_once_not_a_hang(limited):
    streams = [Stream(limited, None, tokens=150).begin() for _ in range(2)]
    idle = open_many(limited.port, 6)  # 2 streams + 6 idle = the limit of 8
    wait_for(lambda: status_of(exchange(limited.port, HEALTH)[0]) == 503, 5,
             "the gateway counts the idle connections")
    for _ in range(5):
        started = time.monotonic()
        answer, closed = exchange(limited.port, HEALTH, timeout=5)
        assert time.monotonic() - started < 2, "an excess connection waited"
        assert status_of(answer) == 503 and closed, answer[:200]
    for sock in idle:
        sock.close()
    for stream in streams:
        assert stream.finish().completed, stream.finish_reason
    with Honest(limited, minimum=6):  # back below the limit: everyone is served again
        pass
