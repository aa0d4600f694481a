"""The PD latency model and the joint pair choice, on servers with given figures (no sockets)."""

from __future__ import annotations

import time

import pytest

from gateway.errors import BadRequest
from gateway.policies.slo import SloOptions, SloPolicy, near_turn
from gateway.servers.pool import Rank
from gateway.slo.model import LatencyModel, predicted_wait
from gateway.slo.objectives import Objectives, SloClass
from gateway.slo.physics import H200_LLAMA3_8B
from gateway.slo.ticket import Ticket
from tests.unit.builders import generate_ids, server

PROMPT = list(range(4000))  # 4000 prompt tokens


@pytest.mark.parametrize(("new", "cached", "measured_ms"), [
    pytest.param(1024, 0, 21.6, id="1k_new"),
    pytest.param(4096, 0, 92.0, id="4k_new"),
    pytest.param(16384, 0, 455.0, id="16k_new"),
    pytest.param(256, 8192, 17.9, id="256_after_8k_cached"),
])
def test_prefill_prior_follows_the_h200_run(new, cached, measured_ms) -> None:
    seconds = H200_LLAMA3_8B.prefill(new, cached)
    assert seconds * 1e3 == pytest.approx(measured_ms, rel=0.25)


@pytest.mark.parametrize(("batch", "context", "measured_ms"), [
    pytest.param(1, 1024, 4.2, id="batch_1"),
    pytest.param(128, 128 * 1024, 9.0, id="batch_128_1k"),
    pytest.param(256, 256 * 4096, 37.4, id="batch_256_4k"),
])
def test_decode_prior_follows_the_h200_run(batch, context, measured_ms) -> None:
    assert H200_LLAMA3_8B.decode_step(batch, context) * 1e3 == pytest.approx(measured_ms,
                                                                              rel=0.1)


def test_measured_speed_replaces_the_prior_and_queue_waits_on_it() -> None:
    slow = server("p", load={"prefill_speed": 10_000.0, "waiting_uncached_tokens": 20_000},
                  age=1.0)
    polled = slow.load.updated_at
    assert predicted_wait(slow, polled) == pytest.approx(2.0)
    model = LatencyModel()
    wait, compute = model.prefill_part(slow, 1000, 0, polled)
    assert wait == pytest.approx(2.0)
    # a second after its poll the server has prefilled 10,000 of them: 1 s left ahead
    assert predicted_wait(slow, polled + 1.0) == pytest.approx(1.0)
    assert model.prefill_part(slow, 1000, 0, polled + 1.0)[0] == pytest.approx(1.0)
    # never less than what this gateway itself has in flight there
    slow.in_flight_tokens = 15_000
    assert predicted_wait(slow, polled + 1.0) == pytest.approx(1.5)
    assert compute == pytest.approx(0.1 + H200_LLAMA3_8B.prefill_fixed, rel=0.05)


def test_stale_report_counts_only_the_gateways_own_queue() -> None:
    stale = server("p", tokens=4000, load={"waiting_uncached_tokens": 90_000,
                                           "prefill_speed": 20_000.0}, age=60.0)
    assert predicted_wait(stale) == pytest.approx(0.2)


def test_learned_factors_converge_on_what_is_observed() -> None:
    model = LatencyModel()
    p, d = server("p", load={"prefill_speed": 20_000.0}, age=1.0), server("d", "decode")
    first = model.predict(p, d, 2000, 0)
    for _ in range(40):  # the servers are twice as slow to first token, ITL 3x the prior
        guess = model.predict(p, d, 2000, 0)
        model.observe("p", "d", guess, 2 * first.raw_ttft, 3 * first.raw_itl)
    learned = model.predict(p, d, 2000, 0)
    assert learned.ttft == pytest.approx(2 * first.ttft, rel=0.05)
    assert learned.itl == pytest.approx(3 * first.itl, rel=0.05)
    other = model.predict(p, server("d2", "decode"), 2000, 0)
    assert other.ttft == pytest.approx(learned.ttft, rel=0.05)  # the prefill's own factor


def test_a_full_decode_adds_the_wait_for_a_slot() -> None:
    model = LatencyModel()
    room = server("d", "decode", load={"running": 10, "max_running_requests": 64}, age=1.0)
    full = server("f", "decode", load={"running": 64, "max_running_requests": 64}, age=1.0)
    now = room.load.updated_at
    assert model.decode_part(full, 100, now)[0] > model.decode_part(room, 100, now)[0] + 0.1


def test_a_decode_whose_kv_pool_is_full_adds_the_wait_for_room() -> None:
    """Slots to spare, but the pool holds 120k of 131k tokens: a 20k-token prompt waits for
    9k of them to free (the benchmark's decodes are bound so, loadtests/goodput/where.py)."""
    model = LatencyModel()
    pool = {"running": 20, "max_running_requests": 256, "max_total_tokens": 131072}
    room = server("d", "decode", load={**pool, "used_tokens": 20_000}, age=1.0)
    full = server("f", "decode", load={**pool, "used_tokens": 120_000}, age=1.0)
    now = room.load.updated_at
    free, _ = model.decode_part(room, 20_000, now)
    waits, _ = model.decode_part(full, 20_000, now)
    assert waits > free + 0.5  # (9k / 131k of a 10 s mean duration: ~0.7 s)
    assert model.decode_part(full, 100, now)[0] < free + 0.01  # a short prompt still fits


def test_the_pool_turns_over_at_the_token_weighted_holding_time() -> None:
    """Many short answers holding little KV and a few long prompts holding most of it: the
    pool frees at the pace of the long ones (Little's law), which a mean over requests
    misses: two 1 s answers of 200 tokens for every 10 s one of 8,000 make a mean over
    requests near 4 s, while the pool turns over in about 9.5 s."""
    model = LatencyModel()
    guess = model.predict(server("p"), server("d", "decode"), 100, 0)
    for _ in range(9):
        model.observe("p", "d", guess, None, None, 1.0, 200)
        model.observe("p", "d", guess, None, None, 1.0, 200)
        model.observe("p", "d", guess, None, None, 10.0, 8000)
    turnover = model.turnover("d")
    assert 8.5 < turnover < 10.0
    pool = {"running": 20, "max_running_requests": 256, "max_total_tokens": 100_000}
    full = server("d", "decode", load={**pool, "used_tokens": 100_000}, age=1.0)
    admit, step = model.decode_part(full, 10_000, full.load.updated_at)
    assert admit == pytest.approx(step + 0.1 * turnover)
    assert model.turnover("unknown") == 10.0  # DECODE_DURATION until a decode has answered


# -- the joint choice -------------------------------------------------------------------------


def policy(**options) -> SloPolicy:
    return SloPolicy("prefill", SloOptions(**options))


def warm(policy: SloPolicy, target, ids: list[int]) -> None:
    """`target` was sent `ids` before (the tree says it holds them)."""
    view = generate_ids(ids)
    policy.on_dispatch(target, view)


def never(_p: str, _d: str) -> bool:
    return False


@pytest.mark.parametrize(("holder_queue", "expected"), [
    pytest.param(0, "holder", id="idle_holder_keeps_its_cached_prefix"),
    pytest.param(2_000, "holder", id="short_queue_is_cheaper_than_a_recompute"),
    pytest.param(40_000, "other", id="queue_longer_than_recompute_elsewhere"),
])
def test_joint_choice_prefers_the_cached_prefix_unless_its_queue_is_longer(
        holder_queue, expected) -> None:
    slo = policy()
    speed = {"prefill_speed": 20_000.0}
    holder = server("holder", tokens=holder_queue, load=dict(speed), age=0.0)
    other = server("other", load=dict(speed), age=1.0)
    decode = server("d", "decode")
    warm(slo, holder, PROMPT)
    target, chosen = slo.pick_pair([holder, other], [decode], generate_ids(PROMPT), never)
    assert (target.url, chosen) == (expected, decode)


def test_objective_moves_a_request_whose_anchor_would_miss() -> None:
    slo = policy()
    speed = {"prefill_speed": 20_000.0}
    holder = server("holder", tokens=5_200, load=dict(speed), age=0.0)
    other = server("other", load=dict(speed), age=1.0)
    decode = server("d", "decode")
    warm(slo, holder, PROMPT)
    at_holder = slo.model.predict(holder, decode, 4000, 4000).ttft  # 0.26 s queue, cached
    elsewhere = slo.model.predict(other, decode, 4000, 0).ttft  # 0.2 s recompute, no queue
    assert elsewhere < at_holder < elsewhere * slo.options.move_factor
    view = generate_ids(PROMPT)
    # without an objective the small gain does not pay for a second copy of the prefix
    assert slo.pick_pair([holder, other], [decode], view, never)[0] is holder
    objective = str(round((at_holder + elsewhere) / 2 * 1e3, 1)).encode()
    view.slo = Ticket(Objectives(None).of([(b"x-slo-ttft-ms", objective)], 0))
    target, _ = slo.pick_pair([holder, other], [decode], view, never)
    assert target is other
    assert view.slo.prediction.ttft == pytest.approx(elsewhere)


def test_without_steering_the_anchor_keeps_the_request_and_the_forecast_is_kept() -> None:
    """`steer: false`: an objective the holder misses and another target meets does not take
    the request off the cache-aware choice (it does with steering: the test above); the
    pair's forecast still goes on the ticket, for the gate and for learning."""
    speed = {"prefill_speed": 20_000.0}
    holder = server("holder", tokens=5_200, load=dict(speed), age=0.0)
    other = server("other", load=dict(speed), age=1.0)
    decode = server("d", "decode")
    targets = {}
    for steer in (True, False):
        slo = policy(steer=steer)
        warm(slo, holder, PROMPT)
        at_holder = slo.model.predict(holder, decode, 4000, 4000).ttft
        elsewhere = slo.model.predict(other, decode, 4000, 0).ttft
        objective = str(round((at_holder + elsewhere) / 2 * 1e3, 1)).encode()
        view = generate_ids(PROMPT)
        view.slo = Ticket(Objectives(None).of([(b"x-slo-ttft-ms", objective)], 0))
        targets[steer] = slo.pick_pair([holder, other], [decode], view, never)[0]
        expected = elsewhere if steer else at_holder
        assert view.slo.prediction.ttft == pytest.approx(expected)
    assert targets == {True: other, False: holder}


def test_decode_protection_keeps_new_requests_off_a_decode_at_its_bound() -> None:
    slo = policy()
    p = server("p", load={"prefill_speed": 20_000.0}, age=1.0)
    light = server("light", "decode", load={"running": 150, "used_tokens": 300_000}, age=1.0)
    heavy = server("heavy", "decode", load={"running": 200, "used_tokens": 800_000}, age=1.0)

    def picks() -> set[str]:
        return {slo.pick_pair([p], [light, heavy], generate_ids(PROMPT[:100]), never)[1].url
                for _ in range(4)}

    assert picks() == {"light"}  # by price
    step = slo.model.decode_part(light, 100, light.load.updated_at)[1]
    slo.model.hold("light", step * 0.95)  # one more request there breaks this one's ITL
    assert picks() == {"heavy"}
    assert slo.stats()["moves"]["protected"] == 4
    slo.model.release("light", step * 0.95)
    assert picks() == {"light"}


def test_quarantined_pairs_are_left_out() -> None:
    slo = policy()
    p = server("p", load={"prefill_speed": 20_000.0}, age=1.0)
    d1, d2 = server("d1", "decode"), server("d2", "decode", in_flight=50)
    blocked = lambda pu, du: du == "d1"  # noqa: E731
    assert slo.pick_pair([p], [d1, d2], generate_ids(PROMPT), blocked)[1] is d2


def test_pruning_pairs_at_most_top_k_squared_plus_the_anchor() -> None:
    slo = policy(top_k=3)
    prefills = [server(f"p{i}", tokens=1000 * i) for i in range(50)]
    decodes = [server(f"d{i}", "decode", in_flight=i) for i in range(50)]
    pairs = slo._pairs(prefills, decodes, generate_ids(PROMPT), {}, 40, 0.0, None)
    assert len(pairs) == 4 * 3
    assert {p[0].url for p in pairs} == {"p0", "p1", "p2", "p40"}


# -- objectives ---------------------------------------------------------------------------------


def test_headers_override_class_defaults_in_milliseconds() -> None:
    objectives = Objectives({"batch": SloClass(ttft_ms=5000, itl_ms=100)})
    batch = objectives.of([], 2)
    assert (batch.ttft, batch.itl, batch.on_miss) == (5.0, 0.1, "shed")
    own = objectives.of([(b"x-slo-ttft-ms", b"750"), (b"x-slo-itl-ms", b"40")], 2)
    assert (own.ttft, own.itl) == (0.75, 0.04)
    interactive = objectives.of([], 0)
    assert (interactive.any, interactive.on_miss) == (False, "queue")


@pytest.mark.parametrize("value", [b"0", b"-5", b"nan", b"abc", b"1e99"])
def test_a_bad_objective_header_is_a_400(value) -> None:
    with pytest.raises(BadRequest, match="x-slo-ttft-ms"):
        Objectives(None).of([(b"x-slo-ttft-ms", value)], 1)


def test_dp_ranks_are_targets_and_what_left_is_forgotten() -> None:
    slo = policy()
    whole = server("p")
    ranks = whole.ranks = [Rank(whole, 0), Rank(whole, 1)]
    for rank in ranks:  # each rank reported its own speed (only such forecasts teach a rank)
        rank.load.prefill_speed = 20_000.0
    slo.on_servers_changed(ranks)  # the scheduler hands over targets, ranks among them
    target, _ = slo.pick_pair(ranks, [server("d", "decode")], generate_ids(PROMPT), never)
    slo.model.observe(target.url, "d", slo.model.predict(target, server("d", "decode"),
                                                          4000, 0), 1.0, None)
    assert target.url in slo.model.factors()["ttft"]
    slo.on_servers_changed([])
    assert slo.model.factors()["ttft"] == {}


def test_sequential_requests_on_an_idle_fleet_take_the_decodes_in_turn() -> None:
    slo = policy()
    p = server("p", load={"prefill_speed": 20_000.0}, age=1.0)
    # figures a few KV tokens apart: a few microseconds of predicted step, a tie
    a = server("a", "decode", load={"used_tokens": 1000}, age=1.0)
    b = server("b", "decode", load={"used_tokens": 1200}, age=1.0)
    chosen = [slo.pick_pair([p], [a, b], generate_ids(list(range(i, i + 300))), never)[1].url
              for i in range(6)]
    assert sorted(chosen) == ["a", "a", "a", "b", "b", "b"]


@pytest.mark.parametrize(("costs", "picks"), [
    pytest.param([0.0124, 0.0126], {0, 1}, id="straddling_a_rounding_edge_still_tie"),
    pytest.param([0.010, 0.020], {0}, id="clearly_lower_always"),
    pytest.param([0.200, 0.215], {0, 1}, id="within_the_noise_of_a_learned_factor"),
    pytest.param([0.200, 0.240], {0}, id="beyond_it"),
])
def test_near_costs_are_taken_in_turn(costs, picks) -> None:
    assert {near_turn(costs, 0.005, turn) for turn in range(4)} == picks


def test_an_unobserved_target_starts_at_the_fleets_factor_not_the_prior() -> None:
    model = LatencyModel()
    seen, unseen = (server(u, load={"prefill_speed": 20_000.0}, age=1.0) for u in ("a", "b"))
    d = server("d", "decode")
    for _ in range(40):  # every request 3x slower than the prior says (the gateway's path)
        guess = model.predict(seen, d, 500, 0)
        model.observe("a", "d", guess, 3 * guess.raw_ttft, None)
    assert model.predict(unseen, d, 500, 0).ttft == pytest.approx(
        model.predict(seen, d, 500, 0).ttft, rel=0.05)


def test_without_a_queue_the_anchor_keeps_its_load_spreading() -> None:
    slo = policy()
    a, b = (server(u, load={"prefill_speed": 20_000.0}, age=1.0) for u in ("a", "b"))
    d = server("d", "decode")
    for _ in range(20):  # a learned to be 4x slower than b, nothing queued on either
        for target, slower in ((a, 4.0), (b, 1.0)):
            guess = slo.model.predict(target, d, 50, 0)
            slo.model.observe(target.url, "d", guess, slower * guess.raw_ttft, None)
    assert slo.model.predict(a, d, 50, 0).ttft > 2 * slo.model.predict(b, d, 50, 0).ttft
    chosen = [slo.pick_pair([a, b], [server("d", "decode")], generate_ids([i, i + 1]),
                            never)[0].url for i in range(6)]
    assert sorted(chosen) == ["a", "a", "a", "b", "b", "b"]


def test_forecasts_on_the_prior_speed_learn_apart_from_the_measured_ones() -> None:
    """Before a prefill reports its speed the forecasts use the physics prior's (an 8B
    model's): on a slower model they run several times short. What those requests teach
    goes to the prior's own factor: the fleet's stays what measured forecasts showed, so a
    forecast made once the speed is known is not multiplied by the prior's error (CI-sized
    replay of the 32B cold start: the fleet factor swung 1.0 -> 5.9 -> 0.8 in 3 s)."""
    model = LatencyModel()
    cold, d = server("p"), server("d", "decode")
    for _ in range(20):  # the cold start: 6x the prior's forecast
        guess = model.predict(cold, d, 4000, 0)
        assert not guess.measured
        model.learn_ttft("p", "d", guess, 6 * guess.raw_ttft)
    assert model.factors()["prior"] == pytest.approx(6.0, rel=0.1)
    assert model.factors()["fleet"] == 1.0 and model.factors()["ttft"] == {}
    assert model.predict(cold, d, 4000, 0).ttft == pytest.approx(6 * guess.raw_ttft, rel=0.1)
    warm = server("p", load={"prefill_speed": 9_000.0}, age=1.0)  # it reported its speed
    known = model.predict(warm, d, 4000, 0)
    assert known.measured and known.ttft == known.raw_ttft  # its own speed, no prior factor
    model.learn_ttft("p", "d", known, 1.5 * known.raw_ttft)
    assert model.factors()["fleet"] > 1.0 and model.factors()["prior"] == pytest.approx(6.0,
                                                                                        rel=0.1)


def test_a_pair_no_longer_picked_fades_back_within_the_tie_band_of_its_peers() -> None:
    """A passing fault made one decode's first tokens late: its pair factor rose, so the
    objective traffic left it and nothing could correct it. Unconfirmed, it fades towards
    the fleet's (`FADE`), until the pair is a tie again and is picked (before: for good)."""
    from gateway.policies.slo import NEAR  # noqa: PLC0415 - the policy's tie band
    model = LatencyModel()
    p = server("p", load={"prefill_speed": 20_000.0}, age=1.0)
    slow, fast = server("d1", "decode"), server("d2", "decode")
    start = time.monotonic()
    for _ in range(10):  # during the fault: d1's first tokens 3x late, d2's on time
        guess = model.predict(p, slow, 2000, 0)
        model.observe("p", "d1", guess, 3 * guess.raw_ttft, None, now=start)
        guess = model.predict(p, fast, 2000, 0)
        model.observe("p", "d2", guess, guess.raw_ttft, None, now=start)
    assert model.predict(p, slow, 2000, 0).ttft > (1 + NEAR) * model.predict(p, fast, 2000,
                                                                             0).ttft
    for second in range(1, 21):  # then only d2 is picked, on time, once a second
        guess = model.predict(p, fast, 2000, 0)
        model.observe("p", "d2", guess, guess.raw_ttft, None, now=start + second)
    assert model.predict(p, slow, 2000, 0).ttft > (1 + NEAR) * model.predict(p, fast, 2000,
                                                                             0).ttft
    for second in range(21, 121):  # two minutes after the fault it is a tie again
        guess = model.predict(p, fast, 2000, 0)
        model.observe("p", "d2", guess, guess.raw_ttft, None, now=start + second)
    assert model.predict(p, slow, 2000, 0).ttft <= (1 + NEAR) * model.predict(p, fast, 2000,
                                                                              0).ttft
