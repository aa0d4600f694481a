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
