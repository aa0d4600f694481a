"""Readiness progress on stderr: which servers are up and how long it has taken.

SGLang takes tens of seconds to start; without this a silent terminal looks hung. On a TTY the
line is redrawn in place; otherwise (CI logs) a line is printed on change or every 10 s.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from typing import TextIO

from backends.launcher.server import ServerHandle, ServerState


def render(servers: Sequence[ServerHandle], elapsed_s: float) -> str:
    ready = sum(server.state is ServerState.READY for server in servers)
    states = ", ".join(f"{server.name} {server.state.value}" for server in servers)
    return f"launcher: {ready}/{len(servers)} ready after {elapsed_s:.0f}s ({states})"


async def show_progress(
    servers: Sequence[ServerHandle], stream: TextIO | None = None, period_s: float = 1.0
) -> None:
    """Runs until cancelled; the caller cancels it once readiness is decided."""
    out = stream or sys.stderr
    tty = out.isatty()
    start = time.monotonic()
    last_states: list[ServerState] = []
    last_print = 0.0
    try:
        while True:
            elapsed = time.monotonic() - start
            states = [server.state for server in servers]
            if tty:
                out.write("\r\x1b[2K" + render(servers, elapsed))
                out.flush()
            elif states != last_states or elapsed - last_print >= 10.0:
                out.write(render(servers, elapsed) + "\n")
                out.flush()
                last_print = elapsed
            last_states = states
            await asyncio.sleep(period_s)
    finally:
        out.write(("\r\x1b[2K" if tty else "") + render(servers, time.monotonic() - start) + "\n")
        out.flush()
