"""The in-process cost benchmark drives the real app to 200 answers in every configuration
(it raises if any request fails) and prints one row per configuration."""

from __future__ import annotations

import pytest

from loadtests import logic_cost


@pytest.mark.parametrize("endpoint", ["generate", "chat"])
def test_every_configuration_answers_and_is_reported(endpoint, capsys):
    assert logic_cost.main(["--requests", "256", "--rounds", "1", "--endpoint", endpoint]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows[1:]] == ["| default", "| round_robin", "| fixed"]
    for row in rows[1:]:
        assert float(row.split(" | ")[1]) > 0
