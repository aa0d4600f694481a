"""The `auto` policy, the default: requests without objectives are placed exactly as by
`cache_aware` + `least_load`; requests with objectives keep the cache-aware prefill, and the
SLO model chooses their decode and forecasts them for the gate (`steer` on: the joint `slo`
scorer may also move their prefill) (no sockets)."""

from __future__ import annotations

import random

import pytest

from gateway.config.models import policy_choice
from gateway.config.settings import load_config
from gateway.policies import create_policy
from gateway.policies.auto import AutoPolicy
from gateway.slo.objectives import Objectives, SloClass
from gateway.slo.ticket import Ticket
from tests.unit.builders import generate_ids, server

PROMPT = list(range(4000))
SPEED = {"prefill_speed": 20_000.0}


def never(_p: str, _d: str) -> bool:
    return False


def with_objective(view, headers=((b"x-slo-ttft-ms", b"400"),), klass: int = 1,
                   classes: dict | None = None):
    view.slo = Ticket(Objectives(classes).of(list(headers), klass))
    return view


def without_objective(view):
    view.slo = Ticket(Objectives(None).of([], 1))  # every request carries a ticket
    return view


def config(*argv: str):
    return load_config(["--prefill", "http://p:1", "--decode", "http://d:1", *argv])


def test_the_defaults_are_auto_for_both_roles() -> None:
    cfg = config()
    assert policy_choice(cfg, None, "prefill")[0] == "auto"
    assert policy_choice(cfg, None, "decode")[0] == "auto"
    assert create_policy("auto", "prefill").options.steer is False
    assert create_policy("slo", "prefill").options.steer is True
    assert policy_choice(config("--policy", "cache_aware"), None, "prefill")[0] == "cache_aware"


def test_options_written_for_cache_aware_and_slo_apply_to_auto() -> None:
    cfg = config("--policy", "auto",
                 "--policy-options", '{"cache_aware": {"match_threshold": 0.7, "top_k": 9},'
                 ' "slo": {"top_k": 2, "tie_seconds": 0.01}, "auto": {"tie_seconds": 0.02}}')
    name, options = policy_choice(cfg, None, "prefill")
    policy = create_policy(name, "prefill", options)
    assert (policy.options.match_threshold, policy.options.top_k,
            policy.options.tie_seconds) == (0.7, 2, 0.02)  # cache_aware < slo < auto


def replay(policies: list, role: str, seed: int, objective: bool = False) -> list[list[str]]:
    """The choices of each policy over the same 60 requests: prompts that share prefixes
    (a few system prompts, turns that extend earlier ones), servers whose counters and
    /v1/loads figures change between requests; each policy's dispatches go to its own pick."""
    rng = random.Random(seed)
    servers = [server(f"s{i}", role, load=dict(SPEED), age=1.0) for i in range(3)]
    systems = [list(range(k * 10_000, k * 10_000 + 600)) for k in range(3)]
    sent: list[list[int]] = []
    picks: list[list[str]] = [[] for _ in policies]
    for _ in range(60):
        for w in servers:
            w.in_flight = rng.randrange(4)
            w.in_flight_tokens = rng.randrange(3000)
            w.load.waiting_uncached_tokens = rng.choice((0, 0, 500, 8000))
        if sent and rng.random() < 0.4:
            ids = rng.choice(sent) + [rng.randrange(30_000, 40_000) for _ in range(50)]
        else:
            ids = rng.choice(systems) + [rng.randrange(30_000, 40_000) for _ in range(200)]
        sent.append(ids)
        for policy, seen in zip(policies, picks, strict=True):
            view = generate_ids(ids)
            (with_objective if objective else without_objective)(view)
            if role == "prefill":
                assert policy.pick_pair(servers, [server("d", "decode")], view, never) is None
            chosen = policy.pick(servers, view)
            policy.on_dispatch(chosen, view)
            seen.append(chosen.url)
    return picks


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize(("role", "today"), [("prefill", "cache_aware"),
                                             ("decode", "least_load")])
def test_without_objectives_auto_chooses_exactly_as_the_old_defaults(seed, role, today) -> None:
    auto, old = create_policy("auto", role), create_policy(today, role)
    ours, theirs = replay([auto, old], role, seed)
    assert len(set(theirs)) > 1, "the replay should exercise more than one server"
    assert ours == theirs


def test_with_objectives_auto_steering_chooses_the_pair_by_the_objective() -> None:
    """The anchor (holder of the cached prefix) would miss a 400 ms objective behind its
    queue; another target meets it: `auto` with `steer` moves the request, the default
    `auto` and cache_aware do not; the default still forecasts it for the gate."""
    holder = server("holder", tokens=5_200, load=dict(SPEED), age=0.0)
    other = server("other", load=dict(SPEED), age=1.0)
    decode = server("d", "decode")
    auto, old = create_policy("auto", "prefill", {"steer": True}), \
        create_policy("cache_aware", "prefill")
    default = AutoPolicy("prefill")
    for policy in (auto, old, default):
        policy.on_dispatch(holder, generate_ids(PROMPT))
    objective = auto.model.predict(other, decode, 4000, 0).ttft * 1.1
    headers = ((b"x-slo-ttft-ms", str(round(objective * 1e3, 1)).encode()),)
    assert objective < auto.model.predict(holder, decode, 4000, 4000).ttft  # it would miss
    view = with_objective(generate_ids(PROMPT), headers)
    target, chosen = auto.pick_pair([holder, other], [decode], view, never)
    assert (target, chosen) == (other, decode)
    assert view.slo.prediction is not None  # the gate compares it with what happens
    assert auto.forecast([holder, other], [decode], view).ttft <= objective
    view = with_objective(generate_ids(PROMPT), headers)
    assert default.pick_pair([holder, other], [decode], view, never) == (holder, decode)
    assert view.slo.prediction.ttft > objective  # forecast to miss: the gate decides
    assert default.forecast([holder, other], [decode], view).ttft <= objective
    view = with_objective(generate_ids(PROMPT), headers)
    assert old.pick_pair([holder, other], [decode], view, never) is None
    assert old.pick([holder, other], view) is holder
    assert old.forecast([holder, other], [decode], view) is None  # the gate holds nothing


@pytest.mark.parametrize("how", ["itl_header", "class_default"])
def test_an_itl_objective_alone_gets_decode_protection(how) -> None:
    p = server("p", load=dict(SPEED), age=1.0)
    light = server("light", "decode", load={"running": 150, "used_tokens": 300_000}, age=1.0)
    heavy = server("heavy", "decode", load={"running": 200, "used_tokens": 800_000}, age=1.0)
    auto = AutoPolicy("prefill")
    step = auto.model.decode_part(light, 100, light.load.updated_at)[1]
    auto.model.hold("light", step * 0.95)  # one more request there breaks a running one's ITL

    def view():
        if how == "itl_header":
            return with_objective(generate_ids(PROMPT[:100]), ((b"x-slo-itl-ms", b"200"),))
        return with_objective(generate_ids(PROMPT[:100]), (), klass=0,
                              classes={"interactive": SloClass(itl_ms=200)})

    assert {auto.pick_pair([p], [light, heavy], view(), never)[1].url for _ in range(4)} \
        == {"heavy"}
    plain = without_objective(generate_ids(PROMPT[:100]))
    assert auto.pick_pair([p], [light, heavy], plain, never) is None


def test_the_decode_role_of_auto_protects_requests_with_objectives() -> None:
    """`--policy auto` (or a session's pick, outside the joint path): the decode role gives a
    request with objectives slo's choice, one without least_load's."""
    light = server("light", "decode", load={"running": 150, "used_tokens": 300_000}, age=1.0)
    heavy = server("heavy", "decode", load={"running": 200, "used_tokens": 800_000}, age=1.0)
    auto = AutoPolicy("decode")
    step = auto.model.decode_part(light, 100, light.load.updated_at)[1]
    auto.model.hold("light", step * 0.95)
    objective = ((b"x-slo-itl-ms", b"200"),)
    assert auto.pick([light, heavy], with_objective(generate_ids(PROMPT[:100]),
                                                    objective)) is heavy
    assert auto.pick([light, heavy], without_objective(generate_ids(PROMPT[:100]))) is light
