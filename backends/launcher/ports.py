"""Local ports: which hosts are this machine, whether a port is free, and picking free ports.

The launcher runs every server on this machine, so a server's host is a bind address here;
checking a port means trying to bind it exactly as the server will (with SO_REUSEADDR, like
uvicorn and aiohttp), which ignores connections lingering in TIME_WAIT.

A picked port is bound by its server only later (an SGLang server binds its HTTP port after
loading the model and tokenizer: 60-100 s on a busy CPU machine), so it must not be one the
kernel can hand out meanwhile. bind(0) and connect() take ports from ip_local_port_range
(32768-60999 by default): a port picked that way was taken by an outgoing health-check
connection before SGLang bound it (CI, 2026-12-01). Ports are therefore picked below that
range, as SGLang picks its own later-bound nccl port (`get_free_port_below_ephemeral` in
sglang/srt/utils/network.py, 22000-29999), and away from the ports SGLang and Mooncake pick
for themselves: that nccl range, and Mooncake's transfer-engine RPC (12001 up) and TCP
transport listeners (15000-17000).
"""

from __future__ import annotations

import contextlib
import random
import socket
from collections import deque
from collections.abc import Iterable
from functools import lru_cache

WILDCARDS = frozenset({"0.0.0.0", "::", ""})
QUIET_RANGES = ((30000, 32767), (18000, 21999))  # inclusive; clipped below the ephemeral range
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
RECENT = 512  # ports handed out lately by this process, not handed out again

_recent: deque[int] = deque(maxlen=RECENT)
_reserved: set[int] = set()  # ports this process binds itself later: never handed out


def reserve(port: int) -> None:
    """`port` is this process's own, bound after its servers' ports are picked (the gateway
    builds its launch topology before it binds its listening port): never hand it out."""
    if port:
        _reserved.add(port)


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


def ephemeral_low() -> int:
    """The first port the kernel hands out on its own (32768 when the setting is unreadable)."""
    try:
        with open(EPHEMERAL_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def quiet_ports() -> list[int]:
    """Candidate ports in random order: the quiet ranges, below the ephemeral range."""
    ceiling = ephemeral_low()
    ports = [
        port
        for low, high in QUIET_RANGES
        for port in range(low, min(high, ceiling - 1) + 1)
    ]
    random.shuffle(ports)
    return ports


def free_ports(host: str, count: int, avoid: Iterable[int] = ()) -> list[int]:
    """`count` distinct ports free on `host` right now, none in `avoid` or handed out lately.

    Picked from the quiet ranges (see the module docstring); only when those are all taken does
    it fall back to ports the kernel chooses.
    """
    excluded = set(avoid) | set(_recent) | _reserved
    chosen: list[int] = []
    for port in quiet_ports():
        if len(chosen) == count:
            break
        if port not in excluded and is_port_free(host, port):
            chosen.append(port)
            excluded.add(port)
    if len(chosen) < count:
        chosen += _kernel_ports(host, count - len(chosen), excluded)
    _recent.extend(chosen)
    return chosen


def free_port(host: str = "127.0.0.1") -> int:
    """One free port on `host` (loopback by default), picked as `free_ports` picks."""
    return free_ports(host, 1)[0]


def _kernel_ports(host: str, count: int, excluded: set[int]) -> list[int]:
    """Ports bind(0) hands out; all sockets stay bound until every port is chosen."""
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
