"""Best-effort work an attempt leaves behind: aborts posted to servers, and prefill answers
that trail their finished decode (gateway/dispatch/prefill_tails.py), each bounded in time
and cancelled at shutdown."""

from __future__ import annotations

import asyncio
import contextlib

import orjson

from gateway.dispatch.attempt import Attempt, Timeouts
from gateway.dispatch.prefill_tails import PrefillTails
from gateway.servers.pool import Server
from gateway.timers import Timers
from gateway.upstream.client import Upstream


class Chores:
    def __init__(self, control: Upstream, timers: Timers, timeouts: Timeouts) -> None:
        self.control = control  # the client for control requests (not the data path's)
        self.abort_timeout = timeouts.abort
        self._background: set[asyncio.Task] = set()
        self.tails = PrefillTails(timers, timeouts.tail, self._tail_expired)

    def busy(self) -> bool:
        """Whether an abort or a prefill tail is still running."""
        return bool(self._background) or bool(self.tails)

    def abort(self, server: Server, rids: tuple[str, ...]) -> None:
        """Ask `server` to stop the attempt's items by their upstream rids (unique: random,
        or a client's rid with a random suffix, so SGLang's prefix match hits nothing else)."""
        for one in rids:
            self._spawn(self._post_abort(server, one))

    def finish_tail(self, attempt: Attempt, p_task: asyncio.Task) -> None:
        """The decode is done; give the prefill's own answer a bounded time to arrive."""
        self.tails.add(attempt, p_task)

    def _tail_expired(self, attempt: Attempt, p_task: asyncio.Task) -> None:
        if not p_task.done():
            p_task.cancel()
            self.abort(attempt.prefill, attempt.rid_list)

    async def _post_abort(self, server: Server, rid: str) -> None:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.abort_timeout):
                response = await self.control.post(
                    server.url, "/abort_request", orjson.dumps({"rid": rid}), "abort")
                await response.read()

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        """Cancel what still runs (prefill tails, aborts) at shutdown."""
        tails = self.tails.cancel_all()
        for task in [*self._background, *tails]:
            task.cancel()
        await asyncio.gather(*self._background, *tails, return_exceptions=True)
