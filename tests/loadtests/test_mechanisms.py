"""The per-mechanism cost instruments: every stub names code that exists (a rename fails here,
not as a silent zero in the table), is undone after its block, and leaves every request
answered 200 (`logic_cost` raises otherwise); the floor runs in the same harness."""

from __future__ import annotations

import shutil

import pytest

from loadtests import logic_cost, mechanism_cost, mechanisms

# Each row is two runs under valgrind (about 40x slower, 25-30 s each here with imports): eight
# to ten runs took over the suite's 300 s on the CI machine while the session's SGLang
# servers idled beside them (2026-12-06).
VALGRIND_TIMEOUT = 900


def _current(module: str, path: str) -> object:
    return getattr(*mechanisms.resolve(module, path))


def test_every_stub_replaces_existing_code_and_is_undone():
    targets = [(m, path) for _, patches in mechanisms.STUBS.values() for m, path, _ in patches]
    before = {t: _current(*t) for t in targets}
    with mechanisms.stubbed(mechanisms.names("all")):
        during = {t: _current(*t) for t in targets}
    assert all(during[t] is not before[t] for t in targets)
    assert all(_current(*t) is before[t] for t in targets)


def test_unknown_mechanisms_are_refused():
    with pytest.raises(ValueError, match="nonesuch"):
        mechanisms.names("usage,nonesuch")
    with pytest.raises(SystemExit):
        logic_cost.main(["--without", "nonesuch"])


@pytest.mark.parametrize("endpoint", ["generate", "chat-stream"])
def test_requests_are_still_answered_with_every_mechanism_stubbed(endpoint, capsys):
    assert logic_cost.main(["--requests", "256", "--rounds", "1", "--configs", "default",
                            "--endpoint", endpoint, "--without", "all"]) == 0
    out = capsys.readouterr().out
    assert "--without usage,prefill_usage," in out
    row = next(line for line in out.splitlines() if line.startswith("| default"))
    assert float(row.split(" | ")[1]) > 0


def test_the_floor_runs_in_the_same_harness_and_costs_less(capsys):
    assert logic_cost.main(["--requests", "640", "--rounds", "1",
                            "--configs", "default,floor"]) == 0
    rows = {line.split(" | ")[0]: line.strip("| ").split(" | ")
            for line in capsys.readouterr().out.splitlines() if line.startswith("| ")}
    assert float(rows["| floor"][2]) < float(rows["| default"][2])
    with pytest.raises(ValueError, match="no streams"):
        logic_cost.main(["--requests", "64", "--rounds", "1", "--configs", "floor",
                         "--endpoint", "chat-stream"])


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="needs valgrind")
@pytest.mark.timeout(VALGRIND_TIMEOUT)
def test_the_table_has_a_row_per_change_and_the_floor_below_the_default(capsys):
    assert mechanism_cost.main(["--only", "inflight", "--small", "128", "--large", "448"]) == 0
    rows = [line.strip("| ").split(" | ") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and not line.startswith("| the default less")]
    labels = [row[0] for row in rows]
    assert labels[0] == "nothing (the default)"
    assert labels[1].startswith("without inflight")
    assert any(label.startswith("the floor") for label in labels)
    default = float(rows[0][1].replace(",", ""))
    floor = float(next(r for r in rows if r[0].startswith("the floor"))[1].replace(",", ""))
    assert 10_000 < default < 5_000_000
    assert floor < default / 2  # the floor is a fraction of the gateway's own work


def test_the_workers_mechanisms_are_stubbed_in_the_worker_configuration(capsys, monkeypatch):
    """`shared_prefixes` and `shared_loads` are what a worker of `--workers` adds: stubbed, the
    worker still answers every request, and nothing of its in-flight figures reaches the
    shared block (the stub replaced the publishing)."""
    from gateway.processes.shared_state import ServerShare

    published = []
    monkeypatch.setattr(ServerShare, "publish",
                        lambda share, *figures: published.append(figures))
    assert logic_cost.main(["--requests", "128", "--rounds", "1", "--configs", "worker"]) == 0
    assert published  # the worker configuration publishes (else the stub measures 0)
    published.clear()
    assert logic_cost.main(["--requests", "128", "--rounds", "1", "--configs", "worker",
                            "--without", "shared_prefixes,shared_loads"]) == 0
    assert published == []
    assert "--without shared_prefixes,shared_loads" in capsys.readouterr().out


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="needs valgrind")
@pytest.mark.timeout(VALGRIND_TIMEOUT)
def test_the_worker_table_counts_its_own_mechanisms(capsys):
    # Ten servers, not the default three: the others' sums are read once per candidate, so the
    # saving grows fivefold (1,2: about 10,000 instructions a request; 5,5: about 52,000), well
    # clear of what differencing runs of 128 and 448 requests moves by (a CI run measured
    # -480 with 1,2 on 2026-12-07).
    assert mechanism_cost.main(["--config", "worker", "--only", "shared_loads", "--servers", "5,5",
                                "--small", "128", "--large", "448"]) == 0
    rows = [line.strip("| ").split(" | ") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and not line.startswith("| the worker less")]
    assert [row[0] for row in rows][0] == "nothing (the worker)"
    assert rows[1][0].startswith("without shared_loads")
    assert float(rows[1][2].replace(",", "")) > 0  # publishing and summing cost something
    assert not any(row[0].startswith("the floor") for row in rows)  # one-process rows left out
