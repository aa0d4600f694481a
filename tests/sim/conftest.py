"""Fixtures: simulated servers started once per module, or on demand per test."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import pytest

from tests.sim.simproc import Sim

# Lowered PD timeouts so failure paths finish in about a second.
PD_FLAGS = ("--bootstrap-timeout", "1.5", "--waiting-timeout", "1.0",
            "--bootstrap-retries", "3", "--bootstrap-retry-interval", "0.2")

_rooms = itertools.count(1_000)


@pytest.fixture
def room() -> Callable[[], int]:
    """A fresh bootstrap room per call (rooms are never reused)."""
    return lambda: next(_rooms)


@pytest.fixture
def sim_factory() -> Iterator[Callable[..., Sim]]:
    """Start extra sims inside one test; all are stopped after it."""
    started: list[Sim] = []

    def make(mode: str, *flags: str, **kw: object) -> Sim:
        sim = Sim(mode, *flags, **kw)  # type: ignore[arg-type]
        started.append(sim)
        return sim

    yield make
    for sim in started:
        sim.stop()


@pytest.fixture(scope="module")
def pd_pair() -> Iterator[tuple[Sim, Sim]]:
    """A prefill and a decode sim with lowered timeouts, shared by a module."""
    prefill = Sim("prefill", *PD_FLAGS)
    try:
        decode = Sim("decode", *PD_FLAGS)
    except BaseException:
        prefill.stop()
        raise
    yield prefill, decode
    decode.stop()
    prefill.stop()


@pytest.fixture(scope="module")
def null_sim() -> Iterator[Sim]:
    sim = Sim("null")
    yield sim
    sim.stop()
