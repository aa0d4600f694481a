"""The shared prefix table's benchmark times what a worker runs: every prompt it looks up
was recorded before, so each lookup is a hit (a miss would time less work)."""

from __future__ import annotations

from loadtests import shared_prefix_cost as cost


def test_each_prompt_of_a_block_or_more_is_found_where_it_was_recorded():
    table = cost.new_table()
    keys = cost.prompts(2000, 50)
    assert len(set(keys)) == 50 and all(len(k) == 2000 for k in keys)
    for key in keys:
        table.record(key, cost.TARGETS[0], 1.0)
    found = [table.find(key, cost.TARGETS, 2.0) for key in keys]
    assert all(f is not None and f[0] == cost.TARGETS[0] and f[1] == 2000 - 2000 % 256
               for f in found)


def test_the_table_is_printed_for_each_size(capsys):
    assert cost.main(["--sizes", "100,600", "--prompts", "20", "--rounds", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows[1:]] == ["| 100", "| 600"]
    assert all(float(row.split(" | ")[1].rstrip(" |")) > 0 for row in rows[1:])
