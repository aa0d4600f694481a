"""Whom the scheduler trusts when servers are suspects, just failed, or recovering
(gateway/scheduling/scheduler.py `Scheduler.candidates`)."""

from __future__ import annotations

import time

from gateway.config.models import build_policies, configured_names
from gateway.config.settings import load_config
from gateway.request import parse_request
from gateway.scheduling.models import Models
from gateway.scheduling.scheduler import Scheduler
from gateway.servers.pool import Server, ServerPool

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
