"""Run a `Launcher` on its own event loop in a background thread, behind a blocking API.

Why: pytest fixtures and other synchronous callers need servers that outlive one `asyncio.run`.
The thread keeps the loop (which supervises and restarts servers) alive until `stop()`; the
servers' PR_SET_PDEATHSIG is tied to this thread, so it must not exit before they are stopped.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from backends.launcher.launcher import Launcher
from backends.launcher.server import OnState, ServerHandle
from backends.launcher.topology import Topology

T = TypeVar("T")


class BackgroundLauncher:
    """`start()` blocks until all servers are ready (or raises); `stop()` blocks until all exit."""

    def __init__(self, topology: Topology, on_state: OnState | None = None, **options: Any):
        options.setdefault("handle_signals", False)  # only the main thread may own signals
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="launcher", daemon=True)
        self._thread.start()
        self.launcher: Launcher = self._call(self._build(topology, on_state, options))

    @staticmethod
    async def _build(topology: Topology, on_state: OnState | None, options: Any) -> Launcher:
        return Launcher(topology, on_state, **options)  # created on the loop that will run it

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def servers(self) -> tuple[ServerHandle, ...]:
        return self.launcher.servers

    def start(self) -> BackgroundLauncher:
        try:
            self._call(self.launcher.start())
        except BaseException:
            self._shutdown_loop()
            raise
        return self

    def stop(self) -> None:
        """Idempotent; after it returns no server process is left and the thread has ended."""
        if self._thread.is_alive():
            try:
                self._call(self.launcher.stop())
            finally:
                self._shutdown_loop()

    def _shutdown_loop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        self._loop.close()

    def __enter__(self) -> BackgroundLauncher:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
