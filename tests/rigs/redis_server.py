"""A real redis-server on a free loopback port for the tests of the shared response store
(the Debian package `redis-server`, installed by .ci/setup-extras); nothing is persisted."""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.procs import HOST, Proc, free_port


@contextlib.contextmanager
def redis_server(log_dir: Path) -> Iterator[str]:
    """A running redis-server; yields its URL (redis://127.0.0.1:PORT/0)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed: run .ci/setup-extras")
    port = free_port()
    proc = Proc(f"redis-{port}", [binary, "--bind", HOST, "--port", str(port), "--save", "",
                                  "--appendonly", "no", "--protected-mode", "no"], log_dir)
    url = f"redis://{HOST}:{port}/0"
    try:
        client = redis.Redis.from_url(url, socket_timeout=1)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.RedisError:
                if proc.popen.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start:\n{proc.log()}") from None
                time.sleep(0.05)
        client.close()
        yield url
    finally:
        proc.stop()
