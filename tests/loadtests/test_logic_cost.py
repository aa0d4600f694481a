"""The in-process cost benchmark drives the real app to 200 answers in every configuration
(it raises if any request fails; a stream counts once its [DONE] went out) and prints one row
per configuration."""

from __future__ import annotations

import pytest

from loadtests import logic_cost


@pytest.mark.parametrize("endpoint", ["generate", "chat", "chat-stream"])
def test_every_configuration_answers_and_is_reported(endpoint, capsys):
    assert logic_cost.main(["--requests", "256", "--rounds", "1", "--endpoint", endpoint]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows[1:]] == ["| default", "| round_robin", "| fixed"]
    for row in rows[1:]:
        cells = row.strip("| ").split(" | ")
        assert float(cells[1]) > 0
        if endpoint.endswith("-stream"):  # and what one relayed event costs
            assert 0 < float(cells[4]) < float(cells[2])


def test_the_loops_that_work_per_second_are_stopped_before_measuring():
    """Their share of a run follows its seconds, not its requests (valgrind's runs last as
    long as the machine's load makes them): `instruction_cost` would move with the load."""
    import asyncio

    from gateway.app import build_app
    from gateway.config.settings import load_config

    async def main() -> dict[str, bool]:
        app = build_app(load_config(logic_cost.SERVERS))
        async with app.app.router.lifespan_context(app.app):
            tasks = asyncio.all_tasks() - {asyncio.current_task()}
            logic_cost._stop_clocked_loops()
            await asyncio.sleep(0)
            return {t.get_coro().__qualname__: t.cancelled() for t in tasks}

    states = asyncio.run(main())
    assert logic_cost.CLOCKED <= states.keys()
    assert all(states[name] for name in logic_cost.CLOCKED)
    assert not any(done for name, done in states.items() if name not in logic_cost.CLOCKED)
