"""Fixtures of the fault suite, and a table of measured detection and recovery times.

Tests call `timing(fault, what, seconds)`; the figures are printed after the run (and kept in
pytest's cache under `reliability/timings`), so docs/RELIABILITY.md quotes measured numbers.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Iterator

import pytest

from tests.rigs.faults import Rig, running_rig

TIMINGS = pytest.StashKey[dict]()


@pytest.fixture
def make_rig(tmp_path) -> Iterator[Callable[..., Rig]]:
    """Start a rig (default 2 prefill + 2 decode) with the given gateway flags; stopped at
    the end of the test whatever happens."""
    with contextlib.ExitStack() as stack:
        def make(*gateway_args: str, **options) -> Rig:
            return stack.enter_context(running_rig(tmp_path, gateway_args, **options))

        yield make


@pytest.fixture
def timing(request) -> Callable[[str, str, float], None]:
    store = request.config.stash.setdefault(TIMINGS, {})

    def record(fault: str, what: str, seconds: float) -> None:
        store.setdefault(f"{fault} | {what}", []).append(round(seconds, 3))

    return record


def pytest_terminal_summary(terminalreporter, config) -> None:
    store = config.stash.get(TIMINGS, None)
    if not store:
        return
    cache = getattr(config, "cache", None)  # absent with -p no:cacheprovider
    if cache is not None:
        cache.set("reliability/timings", store)
    terminalreporter.section("reliability: measured times (s)")
    for key, values in sorted(store.items()):
        terminalreporter.write_line(
            f"{key}: n={len(values)} median={statistics.median(values):.3f} "
            f"max={max(values):.3f}")
