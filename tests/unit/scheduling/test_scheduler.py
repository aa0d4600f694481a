"""Whom the scheduler trusts when servers are suspects, just failed, or recovering
(gateway/scheduling/scheduler.py `Scheduler.candidates`)."""

from __future__ import annotations

import time

from gateway.config.models import build_policies, configured_names
from gateway.config.settings import load_config
from gateway.health.pairs import PairHealth
from gateway.request import parse_request
from gateway.scheduling.models import Models
from gateway.scheduling.scheduler import Scheduler
from gateway.servers.pool import Server, ServerPool
from gateway.slo.objectives import Objectives
from gateway.slo.ticket import Ticket

P = "http://p:1"
D0, D1 = "http://d0:1", "http://d1:1"


def cluster() -> tuple[Scheduler, Server, Server]:
    """One prefill, two decodes (d0, d1), all healthy and verified."""
    cfg = load_config(["--prefill", P, "--decode", D0, "--decode", D1], environ={})
    pool = ServerPool()
    servers = [Server(P, "prefill", 8998, model="m"), Server(D0, "decode", model="m"),
               Server(D1, "decode", model="m")]
    for server in servers:
        server.verified = True
        pool.add(server)
    models = Models(pool, lambda name: build_policies(cfg, name), aliases=cfg.model_aliases,
                    default=cfg.default_model, configured=configured_names(cfg),
                    fallback=cfg.model)
    return Scheduler(pool, models), servers[1], servers[2]


def decodes(scheduler: Scheduler, avoid=()) -> list[str]:
    view = parse_request("chat", b'{"messages": [{"role": "user", "content": "hi"}]}')
    return [s.url for s in scheduler.candidates("decode", view, avoid)]


def recovering(server: Server) -> None:
    """Its breaker opened after failures; its health checks pass."""
    for _ in range(server.breaker.failure_threshold):
        server.breaker.record(False)
    assert not server.usable and server.serving


def test_a_suspect_is_left_while_a_trusted_server_serves():
    scheduler, d0, d1 = cluster()
    d1.suspect_until = time.monotonic() + 10
    assert decodes(scheduler) == [D0]


def test_a_recovering_server_is_tried_before_the_only_usable_one_when_that_one_is_suspect():
    scheduler, d0, d1 = cluster()
    recovering(d0)
    assert decodes(scheduler) == [D1]  # the usable one serves while it is trusted
    d1.suspect_until = time.monotonic() + 10
    assert decodes(scheduler) == [D0]


def test_a_retry_that_just_failed_on_the_only_usable_server_goes_to_a_recovering_one():
    scheduler, d0, d1 = cluster()
    recovering(d0)
    assert decodes(scheduler, avoid=[d1]) == [D0]


def test_a_recovering_suspect_is_not_preferred_over_the_usable_suspect():
    scheduler, d0, d1 = cluster()
    recovering(d0)
    d0.suspect_until = d1.suspect_until = time.monotonic() + 10
    assert decodes(scheduler) == [D1]


def test_a_server_marked_down_by_its_health_checks_is_not_a_recovering_one():
    scheduler, d0, d1 = cluster()
    recovering(d0)
    d0.healthy = False
    d1.suspect_until = time.monotonic() + 10
    assert decodes(scheduler) == [D1]


def test_the_gates_forecast_skips_a_pair_the_pick_skips():
    """A prefill killed under load refuses connections before its health checks mark it
    down: its pair is quarantined (gateway/health/pairs.py) and the pick avoids it, while its
    queue looks empty. The SLO gate's forecast must be of a pair the pick would use, or the
    gate admits a flood on the dead server's empty queue and the pick sends it all to the
    busy one (CI saw a 4.8 s first token against a 2.5 s objective)."""
    cfg = load_config(["--prefill", P, "--prefill", "http://p2:1", "--decode", D0],
                      environ={})
    pool = ServerPool()
    dead, busy = Server(P, "prefill", 8998, model="m"), Server("http://p2:1", "prefill", 8998,
                                                               model="m")
    decode = Server(D0, "decode", model="m")
    for s in (dead, busy, decode):
        s.verified = True
        pool.add(s)
    busy.in_flight, busy.in_flight_tokens = 8, 64_000  # seconds of prefill queued
    models = Models(pool, lambda name: build_policies(cfg, name), aliases=cfg.model_aliases,
                    default=cfg.default_model, configured=configured_names(cfg),
                    fallback=cfg.model)
    pairs = PairHealth()
    scheduler = Scheduler(pool, models, pairs)
    view = parse_request("generate", b'{"text": "' + b"abcd" * 2000 + b'"}')
    view.slo = Ticket(Objectives(None).of([(b"x-slo-ttft-ms", b"1000")], 1))
    assert scheduler.forecast(view).wait == 0.0  # both pairs open: the idle one's forecast
    pairs.record_success(busy.url, decode.url)  # the decode works with the other prefill
    while not pairs.blocked(dead.url, decode.url):
        pairs.record_failure(dead.url, decode.url)
    target, _ = scheduler.pick(view)
    assert target.server is busy
    assert scheduler.forecast(view).wait > 1.0  # the busy pair's queue, as the pick's


def test_only_a_policy_that_learns_from_every_request_asks_for_its_ticket():
    """The SLO gate opens a ticket for a request without objectives only where the model's
    prefill policy learns from it: `slo` (every request is forecast and learned from), not
    the default `auto` (cache_aware then places it). Per model (`--model-policies`)."""
    view = parse_request("generate", b'{"text": "hello"}')
    for flags, learns in (([], False), (["--policy", "slo"], True),
                          (["--prefill-policy", "cache_aware"], False)):
        cfg = load_config(["--prefill", P, "--decode", D0, *flags], environ={})
        pool = ServerPool()
        for server in (Server(P, "prefill", 8998, model="m"), Server(D0, "decode", model="m")):
            server.verified = True
            pool.add(server)
        models = Models(pool, lambda name, cfg=cfg: build_policies(cfg, name),
                        aliases=cfg.model_aliases, default=cfg.default_model,
                        configured=configured_names(cfg), fallback=cfg.model)
        assert Scheduler(pool, models).learns_from_every_request(view) is learns, flags
