"""The switch's own answer bound: SWITCH_TIMEOUT, whatever the drain's deadline (a healthy
switch cut off would be taken out), or the ask's `answer_within` (the rebalancer's, in an
outage), never under the probe timeout."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.servers.role_switch import (
    SWITCH_TIMEOUT,
    SwitchAsk,
    SwitchUnanswered,
    answer_bound,
)
from tests.unit.servers.test_rebalance_hung_switch import FakeSGLang, cluster


@pytest.mark.parametrize(("deadline", "within", "floor", "bound"), [
    (60.0, None, 10.0, SWITCH_TIMEOUT),  # the drain's deadline is not the switch's
    (2.0, None, 10.0, SWITCH_TIMEOUT),
    (0.0, None, 10.0, SWITCH_TIMEOUT),
    (60.0, 10.0, 10.0, 10.0),  # the rebalancer's bound in an outage
    (60.0, 2.0, 10.0, 10.0),  # never under the probe timeout
    (60.0, 900.0, 10.0, SWITCH_TIMEOUT),  # nor over the switch's own bound
])
def test_answer_bound(deadline, within, floor, bound):
    assert answer_bound(SwitchAsk("http://s:1", "prefill", deadline, answer_within=within),
                        floor) == bound


def test_an_answer_bound_gives_up_on_a_hung_switch():
    """A decode hung on its switch, asked with a 2 s answer bound (the probe timeout, the
    floor, is 1 s here): given up on after 2 s (not 300 s) and taken out; its peer serves."""
    async def main() -> tuple[float, object, object]:
        pool, (hung, peer), switcher = await cluster([True, False])
        started = time.monotonic()
        try:
            with pytest.raises(SwitchUnanswered, match="within 2s"):
                await asyncio.wait_for(switcher.switch(
                    SwitchAsk(hung.url, "prefill", 60.0, answer_within=2.0)), 15)
        finally:
            hung.close()
            peer.close()
        return time.monotonic() - started, pool.get(hung.url), pool.get(peer.url)
    took, out, peer = asyncio.run(main())
    assert 2.0 <= took < 5.0
    assert not out.serving and "restart required" in out.misconfigured
    assert peer.serving and peer.role == "decode"


def test_a_drain_deadline_of_zero_still_lets_a_healthy_switch_answer():
    async def main() -> tuple[dict, FakeSGLang]:
        pool, (slow, peer), switcher = await cluster([False, False])
        slow.delay = 0.3  # within the 1 s probe timeout, the floor
        try:
            return await switcher.switch(SwitchAsk(slow.url, "prefill", 0.0)), slow
        finally:
            slow.close()
            peer.close()
    answer, slow = asyncio.run(main())
    assert answer["server"]["role"] == "prefill" and slow.role == "prefill"
