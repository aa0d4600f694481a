"""Picking ports that stay free until a slow server binds them (backends/launcher/ports.py).

The CI failure these guard against: a port from bind(0) was taken by an outgoing connection
during the 80 s an SGLang server spent loading before it bound its HTTP port.
"""

from __future__ import annotations

import contextlib
import socket
from collections import deque
from collections.abc import Iterator

import pytest

from backends.launcher import ports

HOST = "127.0.0.1"


@pytest.fixture(autouse=True)
def fresh_recent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "_recent", deque(maxlen=ports.RECENT))
    monkeypatch.setattr(ports, "_reserved", set())


@contextlib.contextmanager
def listening(port: int) -> Iterator[socket.socket]:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((HOST, port))
        sock.listen()
        yield sock


def free_range(size: int) -> tuple[int, int]:
    """`size` consecutive quiet ports that nothing holds now."""
    for low in range(30000, 32767 - size, size):
        if all(ports.is_port_free(HOST, p) for p in range(low, low + size)):
            return low, low + size - 1
    pytest.skip("no free run of quiet ports on this machine")


def test_picked_ports_are_below_the_kernels_range_and_away_from_sglang_and_mooncake():
    kernel_low = ports.ephemeral_low()
    picked = ports.free_ports(HOST, 300)
    assert len(set(picked)) == 300
    for port in picked:
        assert port < kernel_low
        assert not 22000 <= port <= 29999  # SGLang's own nccl port (get_free_port_below_ephemeral)
        assert not 12000 <= port <= 17999  # Mooncake's RPC and TCP transport listeners
    with contextlib.ExitStack() as stack:  # what bind(0) hands out never meets a picked port
        kernel = set()
        for _ in range(200):
            sock = stack.enter_context(socket.socket())
            sock.bind((HOST, 0))
            kernel.add(sock.getsockname()[1])
    assert kernel.isdisjoint(picked)


def test_a_listening_port_is_never_picked(monkeypatch: pytest.MonkeyPatch):
    low, high = free_range(3)
    monkeypatch.setattr(ports, "QUIET_RANGES", ((low, high),))
    with listening(low + 1):
        assert sorted(ports.free_ports(HOST, 2)) == [low, high]


def test_ports_handed_out_lately_are_not_handed_out_again(monkeypatch: pytest.MonkeyPatch):
    low, high = free_range(4)
    monkeypatch.setattr(ports, "QUIET_RANGES", ((low, high),))
    first = ports.free_ports(HOST, 2)
    second = ports.free_ports(HOST, 2, avoid=())
    assert set(first).isdisjoint(second)
    assert sorted(first + second) == list(range(low, high + 1))


def test_a_reserved_port_is_never_handed_out_though_nothing_holds_it_yet(monkeypatch):
    """The CI failure this guards against: `--launch` picked the gateway's own port, free
    until the gateway bound it, for its prefill's bootstrap port ("already in use")."""
    low, high = free_range(3)
    monkeypatch.setattr(ports, "QUIET_RANGES", ((low, high),))
    ports.reserve(low)
    ports.reserve(0)  # an ephemeral port of the gateway's: nothing to hold back
    assert sorted(ports.free_ports(HOST, 2)) == [low + 1, high]
    assert ports.is_port_free(HOST, low)  # held back, not bound
    assert low not in ports.free_ports(HOST, 3)  # nor handed out by the kernel's fallback


def test_the_launch_topology_holds_back_the_gateways_port(monkeypatch):
    from gateway.config.settings import load_config
    from gateway.launch import topology_of

    low, high = free_range(8)
    monkeypatch.setattr(ports, "QUIET_RANGES", ((low, high),))
    monkeypatch.setattr(ports, "quiet_ports", lambda: list(range(low, high + 1)))  # in order
    topology = topology_of(load_config(["--launch", "--port", str(low)]))
    picked = {p for s in topology.servers for p in (s.port, s.bootstrap_port) if p}
    assert picked and low not in picked


def test_when_the_quiet_ranges_are_taken_the_kernel_chooses(monkeypatch: pytest.MonkeyPatch):
    low, high = free_range(2)
    monkeypatch.setattr(ports, "QUIET_RANGES", ((low, high),))
    with listening(low), listening(high):
        picked = ports.free_ports(HOST, 3)
    assert len(set(picked)) == 3
    assert all(p >= ports.ephemeral_low() for p in picked)


def test_the_quiet_ranges_end_below_a_lowered_ephemeral_range(monkeypatch, tmp_path):
    setting = tmp_path / "ip_local_port_range"
    setting.write_text("20000\t60999\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", str(setting))
    candidates = ports.quiet_ports()
    assert candidates and max(candidates) == 19999 and min(candidates) == 18000
    setting.write_text("garbage")
    assert ports.ephemeral_low() == 32768
