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


class _Recording(logic_cost._Upstream):
    """The benchmark's in-memory upstream, noting which server each leg went to."""

    def __init__(self, answer: bytes) -> None:
        super().__init__(answer, None)
        self.sent: list[str] = []

    async def post(self, base_url, path, body, request_id, headers=()):
        self.sent.append(base_url)
        return await super().post(base_url, path, body, request_id, headers)


def _staged(stage: str, requests: int = 64) -> tuple[list[str], object]:
    """Run `requests` through the app cut at `stage`; the servers the legs went to, and the
    gateway (its counters after the run)."""
    import asyncio

    import orjson

    from gateway.app import build_app
    from gateway.config.settings import load_config
    from loadtests import stages

    async def main():
        upstream = _Recording(orjson.dumps(logic_cost.ANSWERS["generate"]))
        app = build_app(load_config(logic_cost.SERVERS))
        async with app.app.router.lifespan_context(app.app):
            gateway = app.state.gateway
            gateway.dispatcher.upstream = upstream
            logic_cost._stop_clocked_loops()
            with stages.cut(gateway, stage, upstream.answer):
                await logic_cost._drive(stage, app, "generate", requests)  # raises unless 200
            return upstream.sent, gateway

    return asyncio.run(main())


PREFILL = "http://127.0.0.1:1"


@pytest.mark.parametrize("stage", ["endpoint", "picked", "counted"])
def test_the_early_stages_send_no_leg(stage):
    sent, gateway = _staged(stage)
    assert sent == []
    servers = gateway.scheduler.pool.role("prefill") + gateway.scheduler.pool.role("decode")
    assert all(s.in_flight == 0 for s in servers)  # what `counted` took, it gave back
    counted = sum(s.total_requests for s in servers)
    assert (counted > 0) == (stage == "counted")


def test_the_decode_leg_stage_sends_the_decode_leg_alone():
    sent, _ = _staged("decode-leg")
    assert sent and PREFILL not in sent


def test_the_stage_without_the_deadline_sends_both_legs_and_puts_the_deadline_back():
    from gateway.dispatch import pd

    armed = pd.first_deadline
    sent, _ = _staged("no-deadline")
    assert sent.count(PREFILL) == len(sent) // 2 > 0
    assert pd.first_deadline is armed


def test_the_stages_are_configurations_of_the_benchmark(capsys):
    assert logic_cost.main(["--requests", "128", "--rounds", "1", "--configs",
                            "endpoint,picked,counted,decode-leg,no-deadline"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows[1:]] == [
        "| endpoint", "| picked", "| counted", "| decode-leg", "| no-deadline"]
    with pytest.raises(ValueError, match="answers whole"):
        logic_cost.main(["--requests", "64", "--rounds", "1", "--configs", "endpoint",
                         "--endpoint", "chat-stream"])


def test_the_worker_configuration_runs_the_path_of_one_of_eight_workers(monkeypatch, capsys):
    """Its servers publish to a shared block of 8 columns while it runs, the prompt goes
    through the shared prefix table, and the block and the environment are given back."""
    import os

    from gateway.processes.shared_state import ServerShare, SharedState
    from loadtests import worker_mode

    published: list[tuple[int, int]] = []
    attached: list[SharedState] = []
    real_publish, real_share = ServerShare.publish, SharedState.share

    def publish(self, in_flight, tokens):
        published.append((in_flight, tokens))
        real_publish(self, in_flight, tokens)

    def share(self, url, worker):
        attached.append(self)
        return real_share(self, url, worker)

    monkeypatch.setattr(ServerShare, "publish", publish)
    monkeypatch.setattr(SharedState, "share", share)
    before = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    assert logic_cost.main(["--requests", "128", "--rounds", "1", "--configs", "worker"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows[1:]] == ["| worker"]
    assert attached and all(state.workers == worker_mode.WORKERS for state in attached)
    assert len(published) >= 4 * 128  # both servers of each request, as it starts and ends
    assert published[-1][0] == 0 and any(n > 0 for n, _ in published)
    assert os.environ.get("PROMETHEUS_MULTIPROC_DIR") == before
    with pytest.raises(FileNotFoundError):  # unlinked
        SharedState(attached[0].shm.name, worker_mode.WORKERS, 0, "/dev/null")


def test_the_scaling_benchmarks_cluster_can_be_measured(capsys):
    """`--servers 5,5` builds the gateway over five prefills and five decodes, as
    `loadtests.scaling` gives it, so the policies weigh five candidates per role."""
    from gateway.app import build_app
    from gateway.config.settings import load_config

    pool = build_app(load_config(logic_cost.servers(5, 5))).state.gateway.pool
    assert [len(pool.role(r)) for r in ("prefill", "decode")] == [5, 5]
    assert len({s.bootstrap_port for s in pool.role("prefill")}) == 5
    assert logic_cost.main(["--requests", "256", "--rounds", "1", "--configs", "default",
                            "--servers", "5,5"]) == 0
    assert "--servers 5,5" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        logic_cost.main(["--servers", "0,2"])


def test_loads_keep_every_servers_snapshot_fresh_so_the_scores_read_them():
    """`--loads`: the scores take the path a deployment runs (every snapshot fresh,
    `load.all_fresh`), and the capacity test knows each server's KV pool; without it, no
    snapshot is ever taken."""
    import asyncio
    import time

    from gateway.app import build_app
    from gateway.config.settings import load_config
    from gateway.scheduling.load import all_fresh

    async def main(loads: bool) -> tuple[bool, list[int]]:
        app = build_app(load_config(logic_cost.servers(5, 5)))
        async with app.app.router.lifespan_context(app.app):
            pool = app.state.gateway.pool
            poll = asyncio.create_task(logic_cost._polled(pool)) if loads else None
            await asyncio.sleep(0)
            servers = list(pool)
            fresh = all_fresh(servers, time.monotonic(), 6.0)
            if poll is not None:
                poll.cancel()
            return fresh, [w.load.max_total_tokens for w in servers]

    assert asyncio.run(main(True)) == (True, [400000] * 10)
    assert asyncio.run(main(False)) == (False, [0] * 10)
    assert logic_cost.main(["--requests", "128", "--rounds", "1", "--configs", "default",
                            "--servers", "5,5", "--loads"]) == 0
