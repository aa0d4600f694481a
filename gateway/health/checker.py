"""Background health checks with hysteresis, and the `/v1/loads` poller.

A server is marked down after `failures` consecutive failed checks and up again after
`successes` good ones. SGLang's own `/health` runs a one-token generation and can take
seconds under load, so a request that succeeded on the server since the last check also
counts as a good check: slow is not dead. An unverified server (unreachable at startup) is
probed for its role and bootstrap port before it is ever marked up.

A server found refusing connections (restarting) is unverified again, and so is one whose
`/v1/loads` lists another number of DP ranks (restarted between two checks): before, a server
restarted with another `--dp-size` kept its old ranks here for good (rooms steered to a rank
it no longer had: failed handshakes, or decodes waiting on the wrong rank until the
first-progress deadline). One marked down only (slow, not gone) stays verified: panic routing
may still pick it.

A server found back (marked up again, or verified again after it refused connections) counts
a comeback (`Server.comebacks`), which ends the quarantines of its pairs (health/pairs.py):
with one prefill, a dead decode's failures are booked on its pair, and without this the
decode, back and healthy, got no request until the pair's cooldown (10 s) was over.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import httpx

from gateway.servers.pool import Server, ServerPool
from gateway.servers.probe import RoleMismatch, probe

log = logging.getLogger("gateway.health.checker")
FIRST_SPEED_POLL = 0.5  # seconds between /v1/loads polls until a busy prefill has a speed


class HealthChecker:
    def __init__(self, pool: ServerPool, client: httpx.AsyncClient, *, endpoint: str,
                 interval: float, timeout: float, failures: int, successes: int,
                 loads_interval: float, on_down=None, reprobe: bool = True) -> None:
        self.pool = pool
        self.client = client
        self.endpoint = endpoint
        self.interval = interval
        self.timeout = timeout
        self.failures = failures
        self.successes = successes
        self.loads_interval = loads_interval
        self.on_down = on_down  # called with a server just marked down (rescue its requests)
        self.reprobe = reprobe  # learn a server's facts again after it restarted (no --skip-probe)
        self._tasks: dict[str, asyncio.Task] = {}
        self._streak: dict[str, int] = {}
        self._loads_task: asyncio.Task | None = None

    def start(self) -> None:
        for server in self.pool:
            self.watch(server)
        if self.loads_interval > 0:
            self._loads_task = asyncio.get_running_loop().create_task(self._poll_loads())

    def watch(self, server: Server) -> None:
        if server.url not in self._tasks:
            self._tasks[server.url] = asyncio.get_running_loop().create_task(self._loop(server))

    def unwatch(self, url: str) -> None:
        task = self._tasks.pop(url, None)
        if task is not None:
            task.cancel()

    async def stop(self) -> None:
        tasks = list(self._tasks.values()) + ([self._loads_task] if self._loads_task else [])
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()

    async def _loop(self, server: Server) -> None:
        previous = 0.0
        while True:
            started = time.monotonic()
            ok = await self.check(server)
            # a request success counts for one check: the first one begun after it
            self.record(server, ok, since=previous)
            previous = started
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))

    async def _verify(self, server: Server) -> bool:
        """Learn the server's role, bootstrap port, DP ranks and limits from /server_info."""
        try:
            facts = await probe(self.client, server.url, server.role, self.timeout)
        except RoleMismatch as exc:
            log.error("%s", exc)
            server.misconfigured = str(exc)
            return False
        except ConnectionError:
            return False
        server.apply_facts(facts)
        server.comebacks += 1  # a new process (or the first contact): new transfer sessions
        self.pool.notify()
        return True

    def _unverify(self, server: Server) -> None:
        if self.reprobe and server.verified:
            server.verified = False  # out of rotation until probed again

    async def check(self, server: Server) -> bool:
        if not server.verified and not await self._verify(server):
            return False
        refused = False
        try:
            async with asyncio.timeout(self.timeout):
                response = await self.client.get(server.url + self.endpoint)
            ok = response.status_code == 200
        except (httpx.HTTPError, TimeoutError) as exc:
            # refused: nothing listens there (a stalled server still accepts connections)
            refused, ok = isinstance(exc, httpx.ConnectError), False
        server.refused = refused
        if refused:
            self._unverify(server)
        return ok

    def record(self, server: Server, ok: bool, since: float = 0.0) -> None:
        """Apply hysteresis to one check result (a recent request success counts as ok)."""
        if not ok and server.last_success > since and server.last_success > 0:
            ok = True
        streak = self._streak.get(server.url, 0)
        streak = (max(streak, 0) + 1) if ok else (min(streak, 0) - 1)
        self._streak[server.url] = streak
        if server.healthy and streak <= -self.failures:
            server.healthy = False
            log.warning("%s server %s marked DOWN", server.role, server.url)
            if self.on_down is not None:
                self.on_down(server)
        elif not server.healthy and streak >= self.successes and server.verified \
                and not server.held_out:  # (a crashed launched server: the launcher's word)
            server.healthy = True
            server.breaker.reset()
            server.comebacks += 1  # its pairs' quarantines end: the next pick probes them
            log.warning("%s server %s marked UP", server.role, server.url)

    async def _poll_loads(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(min(self.loads_interval, FIRST_SPEED_POLL))
            if time.monotonic() - last < self.loads_interval and not self._speed_unknown():
                continue
            last = time.monotonic()
            await asyncio.gather(*(self._load_of(w) for w in self.pool if w.healthy),
                                 return_exceptions=True)

    def _speed_unknown(self) -> bool:
        """Whether a prefill with requests in flight has not reported its own speed yet: the
        SLO forecasts run on the physics prior's speed until it does (6x too fast for a 32B
        model), and a cold start's burst is admitted on them; polls come every
        `FIRST_SPEED_POLL` seconds until then."""
        return any(server.role == "prefill" and server.healthy
                   and not server.load.prefill_speed and server.totals()[0]
                   for server in self.pool)

    async def _load_of(self, server: Server) -> None:
        with contextlib.suppress(httpx.HTTPError, TimeoutError, ValueError):
            asked = server.ask_loads()
            async with asyncio.timeout(self.timeout):
                response = await self.client.get(server.url + "/v1/loads")
            if response.status_code == 200 and server.apply_loads(response.json(), asked) \
                    and self.reprobe:
                log.warning("%s server %s lists another number of DP ranks: probing it again",
                            server.role, server.url)
                await self._verify(server)
