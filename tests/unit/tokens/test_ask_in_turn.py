"""`InTurn`, the one way a question for any of a model's servers is asked (count_tokens, the
context check's /v1/tokenize): rotated decodes then prefills, a failure handing over at once,
a silent server hedged after its head start, one deadline, the slower asks ended with it."""

from __future__ import annotations

import asyncio

import pytest

from gateway.tokens.ask_in_turn import BYTES_PER_S, InTurn, NoAnswer


class Model:
    def __init__(self, decode: list[str], prefill: list[str]) -> None:
        self.roles = {"decode": decode, "prefill": prefill}

    def usable(self, role: str) -> list[str]:
        return self.roles[role]


class Servers:
    """Asks answered by script: a server's answer, `fail` (NoAnswer) or `hang`."""

    def __init__(self, **script: str) -> None:
        self.script = script
        self.asked: list[tuple[str, float]] = []  # (server, loop time)
        self.cancelled: list[str] = []

    async def ask(self, server: str) -> str:
        self.asked.append((server, asyncio.get_running_loop().time()))
        what = self.script[server]
        if what == "fail":
            raise NoAnswer(f"{server} answered 500")
        if what == "hang":
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.append(server)
                raise
        return what


def ask(servers: Servers, order: list[str], seconds: float = 5.0, head_start: float = 0.2,
        size: int = 0) -> tuple[str, float]:
    """The answer (or the NoAnswer's text) and how long it took."""
    async def go():
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            answer = await InTurn(head_start).ask(order, servers.ask, seconds, size)
        except NoAnswer as exc:
            answer = f"NoAnswer: {exc}"
        return answer, loop.time() - start

    return asyncio.run(asyncio.wait_for(go(), 10))


def test_decodes_then_prefills_each_rotated_per_question():
    in_turn = InTurn()
    model = Model(["d1", "d2", "d3"], ["p1", "p2"])
    orders = [in_turn.servers(model) for _ in range(3)]
    assert orders == [["d2", "d3", "d1", "p2", "p1"], ["d3", "d1", "d2", "p1", "p2"],
                      ["d1", "d2", "d3", "p2", "p1"]]


def test_a_failure_hands_over_at_once():
    servers = Servers(a="fail", b="7")
    answer, took = ask(servers, ["a", "b"], head_start=5.0)
    assert answer == "7" and took < 1.0


def test_a_silent_server_is_hedged_after_its_head_start_and_ended_with_the_question():
    servers = Servers(a="hang", b="7")
    answer, took = ask(servers, ["a", "b"], head_start=0.2)
    assert answer == "7" and 0.15 < took < 1.0
    assert [s for s, _ in servers.asked] == ["a", "b"]
    assert servers.cancelled == ["a"]


def test_the_first_answer_wins_even_from_the_hedged_server():
    servers = Servers(a="hang", b="hang", c="9")
    answer, _ = ask(servers, ["a", "b", "c"], head_start=0.05)
    assert answer == "9" and sorted(servers.cancelled) == ["a", "b"]


def test_one_deadline_for_all():
    servers = Servers(a="hang", b="hang")
    answer, took = ask(servers, ["a", "b"], seconds=0.3, head_start=0.1)
    assert answer == "NoAnswer: no answer in 0.3 s" and 0.25 < took < 1.5
    assert sorted(servers.cancelled) == ["a", "b"]


@pytest.mark.parametrize("order, why", [
    (["a", "b"], "b answered 500"), ([], "no usable server")], ids=["all-failed", "none"])
def test_no_answer_says_why(order, why):
    answer, _ = ask(Servers(a="fail", b="fail"), order)
    assert answer == f"NoAnswer: {why}"


def test_a_large_question_gives_each_server_a_second_more_per_4_mib():
    servers = Servers(a="hang", b="7")
    answer, took = ask(servers, ["a", "b"], seconds=0.3, head_start=0.05, size=BYTES_PER_S // 4)
    assert answer == "7" and took > 0.25  # head start 0.05 + 0.25 s: b asked after 0.3 s
    assert servers.asked[1][1] - servers.asked[0][1] > 0.25
