"""A stand-in asyncio transport that keeps what is written: for tests of code that writes
straight to a connection's transport (the server protocol's one-write answers)."""

from __future__ import annotations


class Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def close(self) -> None:
        self.closed = True
