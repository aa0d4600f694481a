"""A `/v1/loads` answer read after one of our requests ended, though the server took it
before: the request is settled in that snapshot (servers.ServerLoad.carry).

The e2e failure this fixes (tests/e2e_sglang/test_dp.py, CI of 2026-12-01): a conversation's
fourth turn went to the other DP rank. The poll was sent while the third turn's prefill ran
on its rank, the third turn ended, and then the answer arrived, stamped "now": it showed the
rank running one request with its KV in use, after the end that would have taken them off,
so `spread` found the idle rank clearly cheaper.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import pytest

from gateway.health.checker import HealthChecker
from gateway.policies import create_policy
from gateway.scheduling.load import LoadOptions, load_scores
from gateway.servers.pool import Server, ServerPool
from gateway.servers.probe import ServerFacts
from tests.unit.builders import generate_text

URL = "http://127.0.0.1:30000"
BUSY_RANK0 = {"loads": [
    {"dp_rank": 0, "num_running_reqs": 1, "token_usage": 0.1, "max_total_num_tokens": 4096},
    {"dp_rank": 1, "num_running_reqs": 0, "token_usage": 0.0, "max_total_num_tokens": 4096}]}
PROMPT = 410  # tokens: 0.1 of the rank's 4,096


def dp_worker() -> Server:
    server = Server(URL, "prefill")
    server.apply_facts(ServerFacts("prefill", 8998, "m", 2))
    return server


def poll_once(server: Server, during=None) -> None:
    """One `_load_of` through a transport that answers BUSY_RANK0 after `during()` ran (what
    happened while the poll was on its way)."""
    async def answer(request: httpx.Request) -> httpx.Response:
        if during is not None:
            during()
        await asyncio.sleep(0)
        return httpx.Response(200, json=BUSY_RANK0)

    async def go() -> None:
        pool = ServerPool()
        pool.add(server)
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            checker = HealthChecker(pool, client, endpoint="/health", interval=1, timeout=5,
                                    failures=3, successes=2, loads_interval=0)
            await checker._load_of(server)

    asyncio.run(go())


def scores(server: Server) -> list[float]:
    return load_scores(server.ranks, LoadOptions(), time.monotonic())


def test_a_request_that_ended_while_the_poll_was_on_its_way_is_not_in_its_answer() -> None:
    server = dp_worker()
    rank0 = server.ranks[0]
    dispatched = time.monotonic()  # running on rank 0 when the poll is sent
    poll_once(server, during=lambda: rank0.load.settle(dispatched, PROMPT))
    assert rank0.load.running == 1  # the server's figure as read
    assert scores(server) == [pytest.approx(0.0, abs=0.05), 0.0]


def test_without_the_end_the_answer_counts_it() -> None:
    server = dp_worker()
    poll_once(server)
    assert scores(server)[0] == pytest.approx(1 + 32 * 0.1)


def test_a_request_sent_while_the_poll_was_on_its_way_is_taken_off_its_answer() -> None:
    """Dispatched once the poll was on its way and done before the answer: the server may
    have taken the poll after the request arrived (it waits for the scheduler's next step),
    and a finished request is no load, so its end takes it off the answer."""
    server = dp_worker()
    rank0 = server.ranks[0]
    poll_once(server, during=lambda: rank0.load.settle(time.monotonic(), PROMPT))
    assert scores(server) == [pytest.approx(0.0, abs=0.05), 0.0]


def test_a_request_sent_after_the_answer_is_not_taken_off_it() -> None:
    server = dp_worker()
    poll_once(server)
    server.ranks[0].load.settle(time.monotonic(), PROMPT)
    assert scores(server)[0] == pytest.approx(1 + 32 * 0.1)


def test_a_request_sent_mid_poll_and_done_after_the_answer_is_taken_off() -> None:
    """The race of the CI run of 2026-12-03 (tests/e2e_sglang/test_dp.py): a turn sent while
    a poll was on its way, counted by its answer (stamped when it was asked, before the
    turn), ending after the answer arrived. Judged by the stamp it was "not in" the
    snapshot, which then showed the finished turn running on its rank until the next answer,
    and the next turn left the cache for the other rank."""
    server = dp_worker()
    mid: list[float] = []
    poll_once(server, during=lambda: mid.append(time.monotonic()))
    assert server.load.updated_at < mid[0] < server.ranks[0].load.answered_at
    assert server.ranks[0].load.updated_at == server.load.updated_at  # fresh by the ask
    server.ranks[0].load.settle(mid[0], PROMPT)
    assert scores(server) == [pytest.approx(0.0, abs=0.05), 0.0]


def test_a_poll_without_an_answer_settles_nothing_in_the_next_one() -> None:
    server = dp_worker()
    rank0 = server.ranks[0]
    server.ask_loads()  # lost: no answer ever comes
    rank0.load.settle(time.monotonic(), PROMPT)
    assert rank0.load.pending == 1
    poll_once(server)  # the next poll is asked afresh: its answer counts the rank busy
    assert scores(server)[0] == pytest.approx(1 + 32 * 0.1)


def test_the_conversation_stays_on_its_rank_across_the_race() -> None:
    """The decision of the e2e test: the turn after one that ended mid-poll stays."""
    server = dp_worker()
    rank0, rank1 = server.ranks
    policy = create_policy("cache_aware", "prefill")
    policy.on_servers_changed(server.ranks)
    text = "system: be brief\n" + "user: tell me about harbours\nassistant: ok\n" * 30
    policy.on_dispatch(rank0, generate_text(text))  # the previous turn went to rank 0
    dispatched = time.monotonic()
    poll_once(server, during=lambda: rank0.load.settle(dispatched, PROMPT))
    assert policy.pick(server.ranks, generate_text(text + "user: and ships?\n")) is rank0
    unsettled = dp_worker()
    policy.on_servers_changed(unsettled.ranks)
    policy.on_dispatch(unsettled.ranks[0], generate_text(text))
    poll_once(unsettled)  # the same answer without the end: the guard moves the turn
    assert policy.pick(unsettled.ranks, generate_text(text + "user: and ships?\n")) \
        is unsettled.ranks[1]
    assert rank1.load.running == 0


def test_a_request_whose_prefill_answer_trails_is_settled_in_every_poll_until_it_comes() -> None:
    """The decode answered (pd.progress settles the prefill's snapshot) but the prefill's own
    answer is still to come (the CPU rig's prefill answers after the decode): SGLang may hold
    its KV until then, so a poll sent meanwhile shows it, and the answer forgets it. Once
    the prefill leg has ended, a poll's figures count again as they are."""
    server = dp_worker()
    rank0 = server.ranks[0]
    rank0.load.trail(PROMPT)  # progressed before the poll was sent, its prefill still open
    poll_once(server)
    assert scores(server) == [pytest.approx(0.0, abs=0.05), 0.0]
    poll_once(server)  # the next poll too, while it trails
    assert scores(server)[0] == pytest.approx(0.0, abs=0.05)
    rank0.load.trail(PROMPT, -1)  # the prefill answered
    poll_once(server)
    assert scores(server)[0] == pytest.approx(1 + 32 * 0.1)


def test_an_attempt_trails_on_its_server_and_its_rank() -> None:
    """`Attempt.settle_prefill(trail=True)` (what pd.progress calls when the decode answered
    first) starts the trail on the server and on its DP rank; `end_trail` (what
    ledger.Ledger.leg_done calls as the prefill leg ends) ends it on both."""
    from gateway.dispatch.attempt import Attempt
    from tests.unit.builders import generate_text

    server = dp_worker()
    rank0 = server.ranks[0]
    view = generate_text("hello")
    attempt = Attempt(view, server, Server("http://127.0.0.1:30001", "decode"), 1, "r",
                      ("r",), b"", "id", prefill_rank=0)
    attempt.prefill_target = rank0
    attempt.settle_prefill(trail=True)
    assert attempt.trailing
    assert (server.load.trailing, rank0.load.trailing) == (1, 1)
    assert rank0.load.trailing_tokens == view.prompt_tokens
    attempt.end_trail()
    assert not attempt.trailing
    assert (server.load.trailing, rank0.load.trailing, rank0.load.trailing_tokens) == (0, 0, 0)


def count_polls(server: Server, seconds: float, loads_interval: float) -> int:
    """`/v1/loads` polls the checker's loop sends to `server` within `seconds`."""
    polls = []

    async def answer(request: httpx.Request) -> httpx.Response:
        polls.append(request.url.path)
        return httpx.Response(200, json={"loads": [{"dp_rank": 0, "num_running_reqs": 1}]})

    async def go() -> None:
        pool = ServerPool()
        pool.add(server)
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            checker = HealthChecker(pool, client, endpoint="/health", interval=1, timeout=5,
                                    failures=3, successes=2, loads_interval=loads_interval)
            task = asyncio.create_task(checker._poll_loads())
            await asyncio.sleep(seconds)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    asyncio.run(go())
    return len(polls)


def busy_prefill(speed: float = 0.0) -> Server:
    server = Server(URL, "prefill")
    server.apply_facts(ServerFacts("prefill", 8998, "m", 1))
    server.start(4000)  # a request in flight
    server.load.prefill_speed = speed
    return server


def test_a_busy_prefill_without_a_speed_is_polled_at_once_then_at_the_interval() -> None:
    """Until a prefill with work reports its own speed, the SLO forecasts use the prior's
    (6x too fast on a 32B model): the loads are read every 0.5 s instead of every interval
    (30 s here, so any poll within 1.6 s is the fast one), and not once the speed is known
    or while the prefill is idle."""
    assert count_polls(busy_prefill(), 1.6, 30.0) >= 2
    assert count_polls(busy_prefill(speed=9000.0), 1.6, 30.0) == 0
    idle = busy_prefill()
    idle.finish(4000, None)
    assert count_polls(idle, 1.6, 30.0) == 0
