"""A head that declares a large body and sends none holds no memory for it.

The body reader once allocated a bytearray of the declared `Content-Length` before a byte
arrived, zero-filled (so really held), while the in-flight body budget charges only the bytes
received: 40 heads of 33 MB each took one process from 72 to 1,331 MiB, far past the 256 MiB
budget, with no key needed on the defaults. The buffer now grows as the body arrives.
"""

from __future__ import annotations

import socket
from pathlib import Path

from tests.security.conftest import INFERENCE_KEY_A
from tests.security.honest import connect

HEADS = 20
DECLARED = 30_000_000  # under the default --max-body-bytes (32 MiB): each head is admitted


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def test_heads_declaring_large_bodies_hold_no_memory_for_them(keyed):
    pid = keyed.proc.popen.pid
    head = (f"POST /generate HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
            f"content-length: {DECLARED}\r\nauthorization: Bearer {INFERENCE_KEY_A}\r\n"
            "\r\n").encode()
    assert keyed.post("/generate", keyed.headers, json={"text": "warm", "sampling_params": {
        "max_new_tokens": 2}}).status_code == 200
    before = rss_mib(pid)
    socks: list[socket.socket] = []
    try:
        for _ in range(HEADS):
            sock = connect(keyed.port)
            sock.sendall(head + b"{")  # one byte of the body: the reader is at work
            socks.append(sock)
        # requests served after them, each many loop turns: the heads were read by then
        for _ in range(3):
            assert keyed.post("/generate", keyed.headers, json={
                "text": "hi", "sampling_params": {"max_new_tokens": 2}}).status_code == 200
        grown = rss_mib(pid) - before
    finally:
        for sock in socks:
            sock.close()
    assert grown < 64, f"{grown:.0f} MiB held for {HEADS} heads of {DECLARED} bytes declared"
