"""Local ports: which hosts are this machine, whether a port is free, and picking free ports.

The launcher runs every server on this machine, so a server's host is a bind address here;
checking a port means trying to bind it exactly as the server will (with SO_REUSEADDR, like
uvicorn and aiohttp), which ignores connections lingering in TIME_WAIT.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterable
from functools import lru_cache

WILDCARDS = frozenset({"0.0.0.0", "::", ""})


@lru_cache(maxsize=1)
def local_addresses() -> frozenset[str]:
    """Addresses that name this machine: loopback, wildcards, and the hostname's addresses."""
    names = {"localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()}
    addresses = set(WILDCARDS) | names
    for name in names:
        with contextlib.suppress(OSError):
            for info in socket.getaddrinfo(name, None):
                addresses.add(str(info[4][0]))
    return frozenset(addresses)


def is_local(host: str) -> bool:
    """True when `host` is an address of this machine (any 127.x counts as loopback)."""
    return host in local_addresses() or host.startswith("127.")


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _bind_host(host: str) -> str:
    return "127.0.0.1" if host == "localhost" else host


def is_port_free(host: str, port: int) -> bool:
    """Try to bind host:port as a server would; False if something already listens there."""
    try:
        with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((_bind_host(host), port))
    except OSError:
        return False
    return True


def free_ports(host: str, count: int, avoid: Iterable[int] = ()) -> list[int]:
    """`count` distinct ports free on `host` right now, none of them in `avoid`.

    All sockets stay bound until every port is chosen, so the OS never hands out one twice.
    """
    excluded = set(avoid)
    chosen: list[int] = []
    with contextlib.ExitStack() as stack:
        while len(chosen) < count:
            sock = stack.enter_context(socket.socket(_family(host), socket.SOCK_STREAM))
            sock.bind((_bind_host(host), 0))
            port = int(sock.getsockname()[1])
            if port not in excluded:
                excluded.add(port)
                chosen.append(port)
    return chosen
