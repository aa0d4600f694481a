"""Blame by evidence (gateway/dispatch/blame.py): the server of a failed pair that served
requests a moment ago is not avoided by the retry nor made a suspect; its silent partner is.
The samples of an n > 1 request share what they blamed (gateway/dispatch/proxy.py `Shared`),
and a blamed server that served since is picked again (docs/RELIABILITY.md, "Rolling
faults")."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from gateway.dispatch import rescue
from gateway.dispatch.attempt import Answer
from gateway.dispatch.blame import RECENT, culprits
from gateway.dispatch.inflight import Tracked
from gateway.dispatch.parallel_samples import Placement
from gateway.dispatch.proxy import Proxy, Shared
from gateway.errors import UpstreamError
from gateway.health.deadlines import LatencyModel
from gateway.servers.pool import Server
from tests.unit.fakes import FakeCluster, FakeServer, run, served_gateway

PA, PB = "http://pa:1", "http://pb:1"
DA, DB = "http://da:1", "http://db:1"


def _target(body: dict) -> bool:
    return body.get("text") == "target"


def _server(role: str, alive: bool) -> Server:
    server = Server("http://s:1", role)
    server.last_success = time.monotonic() - (0.1 if alive else 2 * RECENT)
    return server


@pytest.mark.parametrize(("prefill_alive", "decode_alive", "leg", "own", "rescued", "blamed"), [
    (True, False, "prefill", False, False, ("decode",)),
    (False, True, "decode", True, False, ("prefill",)),
    (True, True, "decode", True, False, ("decode",)),
    (True, True, "decode", False, False, ("prefill", "decode")),
    (True, True, "both", True, False, ("prefill", "decode")),
    (False, False, "decode", True, False, ("prefill", "decode")),
    (False, False, "decode", False, True, ("decode",)),
    (True, True, "prefill", False, True, ("prefill",)),
], ids=["silent-decode", "silent-prefill", "both-alive-own-failure", "both-alive-status",
        "both-alive-both-late", "both-silent", "rescued-decode", "rescued-prefill"])
def test_culprits(prefill_alive, decode_alive, leg, own, rescued, blamed):
    prefill, decode = _server("prefill", prefill_alive), _server("decode", decode_alive)
    found = culprits(prefill, decode, leg, own, rescued)
    assert tuple(s.role for s in found) == blamed


class _Hung:
    """What `suspect_if_hung` reads of an attempt that waited its deadline without progress."""

    def __init__(self, prefill: Server, decode: Server) -> None:
        self.prefill, self.decode = prefill, decode
        self.progressed = False
        self.started_at = 0.0


def test_a_hang_makes_only_the_silent_server_a_suspect():
    """A frozen decode left its sound prefill waiting: the prefill, which served others a
    moment ago, stays trusted (before: both suspects, and new requests went to the other,
    hung, prefill)."""
    prefill, decode = _server("prefill", True), _server("decode", False)
    rescue.suspect_if_hung(_Hung(prefill, decode), now=5.0, first=5.0, seconds=10.0)
    assert decode.suspect_until > time.monotonic()
    assert prefill.suspect_until == 0.0


def _from_pb(body: dict) -> bool:
    """A decode's leg whose prefill is PB, which never sends the KV: "transfer failed"."""
    return _target(body) and body.get("bootstrap_host") == "pb"


def test_the_retry_keeps_the_sound_prefill_after_its_decode_failed():
    """PA and DB served requests a moment ago; DA fails this request and PB never sends its
    KV (its decode answers 500). Round robin picks PA+DA first: DA fails and the retry keeps
    PA, avoiding DA only; its next pick, PB+DB, fails on DB, and the evidence blames PB
    (DB serves): PA+DB serves it. Before, both servers of each failed pair were avoided, so
    the retries alternated PA+DA and PB+DB and the request failed after all its attempts."""
    cluster = FakeCluster({PA: FakeServer("prefill"), PB: FakeServer("prefill"),
                           DA: FakeServer("decode", fail_if=_target),
                           DB: FakeServer("decode", fail_if=_from_pb)})

    async def go():
        async with served_gateway(cluster, "--retry-backoff-max", "0.05",
                                  "--breaker-failures", "100") as (client, gw):
            now = time.monotonic()
            for url in (PA, DB):
                gw.pool.get(url).last_success = now  # they serve others
            return await client.post("/generate", json={"text": "target"})

    r = run(go())
    assert r.status_code == 200, r.text
    decode_legs = [(url, b["bootstrap_host"]) for url in (DA, DB)
                   for b in cluster.servers[url].received if _target(b)]
    assert sorted(decode_legs) == [(DA, "pa"), (DB, "pa"), (DB, "pb")], decode_legs


class _Target:
    def __init__(self, server: Server) -> None:
        self.server, self.rank = server, None


class _Picks:
    """A scheduler stub: the first decode not avoided; records what each pick avoided."""

    def __init__(self, prefill: Server, decodes: list[Server]) -> None:
        self.prefill, self.decodes = prefill, decodes
        self.avoided: list[set[str]] = []
        self.pool = SimpleNamespace(role=lambda role: [self.prefill, *self.decodes])

    def pick(self, view, avoid, prefer):
        self.avoided.append({s.url for s in avoid})
        fresh = [d for d in self.decodes if d not in avoid] or self.decodes
        return _Target(self.prefill), fresh[0]

    def by_policy(self, view, target, prefer) -> bool:
        return True


class _Attempt:
    """What the proxy and `Placement.started` touch of an attempt."""

    def __init__(self, prefill: Server, decode: Server) -> None:
        self.prefill, self.decode = prefill, decode
        self.trace = self.prefill_rank = self.prefill_future = None
        self.not_after, self.resumable = 0.0, False
        self.started_at, self.urgency = asyncio.get_running_loop().time(), 0


class _Dispatch:
    """A dispatcher stub: a decode in `broken` fails at once (500), any other answers."""

    def __init__(self, broken: set[str]) -> None:
        self.broken = broken
        self.timers = SimpleNamespace(loop=asyncio.get_running_loop)
        self.model = LatencyModel()

    def prepare(self, view, prefill, decode, tracked, rank):
        return _Attempt(prefill, decode)

    async def run(self, attempt, by_policy):
        if attempt.decode.url in self.broken:
            raise UpstreamError("decode answered 500", leg="decode",
                                server_url=attempt.decode.url, retryable=True, status=502)
        attempt.prefill.last_success = time.monotonic()
        return Answer(200, b"application/json", b"{}")


def test_the_samples_of_one_request_avoid_what_one_of_them_found_broken():
    """Sample 0 fails on DA (silent; the prefill serves): sample 1's first pick already
    avoids DA. Before, each sample met the broken decode by itself."""
    prefill = Server(PA, "prefill")
    decodes = [Server(DA, "decode"), Server(DB, "decode")]
    prefill.last_success = time.monotonic()

    async def go():
        picks = _Picks(prefill, decodes)
        metrics = SimpleNamespace(retries=SimpleNamespace(
            labels=lambda *a: SimpleNamespace(inc=lambda: None)))
        proxy = Proxy(picks, _Dispatch({DA}), metrics, max_attempts=5, backoff=0.001,
                      backoff_max=0.01, request_timeout=60.0, failover=False)
        view = SimpleNamespace(stream=False, n=1)
        tracked = Tracked("r", "owner")
        placement = Placement()
        for _ in range(2):  # the samples, one after the other
            await proxy.handle(view, tracked, placement=placement)
        return picks.avoided

    avoided = asyncio.run(go())
    assert avoided == [set(), {DA}, {DA}], avoided


def test_a_blamed_server_that_served_since_is_picked_again():
    """Every decode was blamed in turn (faults rolling over them): the one that completed a
    request since it was blamed is not avoided any more, the others still are."""
    shared = Shared()
    recovered, broken = Server(DA, "decode"), Server(DB, "decode")
    shared.blame((recovered, broken))
    assert set(shared.avoiding()) == {recovered, broken}
    recovered.last_success = time.monotonic() + 1.0  # it served another request since
    assert shared.avoiding() == [broken]
