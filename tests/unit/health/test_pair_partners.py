"""`PairHealth.partners`: the decodes a prefill may pair with now, as `blocked` says one by
one; the very list given while no pair has failed (the usual pick)."""

from dataclasses import dataclass

from gateway.health.pairs import PairHealth


@dataclass
class Decode:
    url: str


def test_no_failed_pair_gives_the_list_itself():
    pairs = PairHealth()
    pairs.record_success("p1", "d1")
    decodes = [Decode("d1"), Decode("d2")]
    assert pairs.partners("p1", decodes) is decodes


def test_a_quarantined_pair_is_left_out_as_blocked_says():
    now = [100.0]
    pairs = PairHealth(threshold=1, clock=lambda: now[0])
    pairs.record_success("p1", "d2")  # both servers work with other partners:
    pairs.record_success("p2", "d1")  # the failure is the pair's own
    assert pairs.record_failure("p1", "d1") is True
    decodes = [Decode("d1"), Decode("d2")]
    assert pairs.blocked("p1", "d1")
    assert pairs.partners("p1", decodes) == [decodes[1]]
    assert pairs.partners("p2", decodes) == decodes
    now[0] += 3600  # its cooldown over: no longer blocked
    assert pairs.partners("p1", decodes) == decodes
