"""--rebalance when every prefill is down: a decode is switched to prefill and the gateway
serves again, where before it answered 503 for as long as the prefills stayed down.

1 prefill + 3 decodes (simulated, able to switch roles); the prefill is killed for good.
With no prefill serving the pressures read an idle role, so no pressure ever asked for one
(gateway/servers/rebalance.py, `without_prefill`). Now, after a whole window (2 s here) with
every prefill down, the cheapest of the decodes, of which 2 stay, becomes a prefill.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest

from tests.reliability.test_role_switch import FLAG, GATEWAY_ARGS, SwitchRig
from tests.rigs.faults import wait_until
from tests.rigs.load import OK, Load

pytestmark = pytest.mark.timeout(120)

REBALANCE = (*GATEWAY_ARGS, "--rebalance", "--rebalance-window", "2",
             "--rebalance-cooldown", "5")
DECISIONS = "gateway_rebalance_decisions_total"
SERVES_AGAIN_WITHIN = 15.0  # down detected (~1 s), a window (2 s), the switch, readings


def roles(rig: SwitchRig) -> dict[str, int]:
    counts = {"prefill": 0, "decode": 0}
    for snap in rig.snapshots().values():
        if snap["usable"]:
            counts[snap["role"]] += 1
    return counts


@pytest.fixture
def rig(tmp_path) -> Iterator[SwitchRig]:
    with contextlib.ExitStack() as stack:
        made = SwitchRig(tmp_path, REBALANCE, 1, 3, (FLAG,))
        stack.callback(made.close)
        yield made.start()


def test_a_decode_becomes_the_prefill_when_every_prefill_is_down(rig, timing):
    with Load(rig.gateway, loops=2, max_new_tokens=8, timeout=15) as load:
        load.wait_count(10, since=0, timeout=30)
        killed_at = rig.kill(rig.prefill[0])
        wait_until(lambda: roles(rig) == {"prefill": 1, "decode": 2}, SERVES_AGAIN_WITHIN,
                   "a decode switched to prefill", detail=lambda: roles(rig))

        def served_since_switch() -> int:
            return sum(1 for o in load.outcomes[:] if o.kind == OK and o.started > switched)

        switched = time.monotonic()
        wait_until(lambda: served_since_switch() >= 10, 15, "requests served again")
        timing("every prefill down, --rebalance", "a decode switched to prefill after",
               switched - killed_at)
    metrics = rig.metrics()
    assert metrics.total(DECISIONS, **{"from": "decode", "to": "prefill",
                                       "reason": "prefill_down", "outcome": "switched"}) == 1
    assert metrics.total(DECISIONS) == 1
    assert "prefill_down" in rig.gateway_proc.log()
