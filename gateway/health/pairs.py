"""Health per (prefill, decode) pair: SGLang PD can fail for one pair only.

A broken Mooncake session between one prefill and one decode makes that pair answer 500s
while each server works with its other partners (SGLang issue #13054). Blaming the servers
would open both breakers and take healthy capacity away; ignoring it would keep sending
requests into a pair that cannot work. So a failure of an attempt is first checked against
the two servers' last outcomes with OTHER partners, within `window` seconds: if one of them
succeeded with another partner and neither failed with one, the failure is the pair's, not
theirs, and it counts only against the pair (`record_failure` returns True: the caller
keeps it away from the servers' breakers). One server's evidence suffices: a decode that so
far only ever worked with the prefill it now fails with has none of its own (seen as a
breaker opened on a healthy decode in the reliability suite, once in a few runs, when the
pair broke before the policy had paired it with the other prefill). A server that fails
with everyone loses that evidence with its second partner, so its breaker still opens.

After `threshold` pair failures in a row the pair is quarantined: the scheduler does not pair
those two servers while another partner is usable. After `cooldown` seconds one probe request
may use the pair again; its success clears the quarantine, its failure renews it (the cooldown
doubles, up to `max_cooldown`).

A quarantine ends early when one of its servers comes back (`Server.comebacks`: its health
checks marked it up again, or probed it again after it refused connections). The pair's
verdict was "the servers work, the pair does not"; a server whose own health checks failed
meanwhile was the one at fault after all, which the pair rule could not see with a single
prefill (the prefill works with the other decode, and the dead decode has no other partner
to prove it at fault, so its every failure is booked on the pair). The next pick then probes
the pair at once, one request, as after a cooldown: its success clears the quarantine, its
failure renews it with the cooldown doubled. Without it, a restarted decode, healthy again
within a health check, got nothing for the rest of the cooldown (8.5 s of 10 in
tests/reliability/test_decode_return.py). A pair broken while both servers pass their health
checks (a dead transfer session) is not touched: neither server comes back from anything.
The failures stay booked on the pair, so the decode's breaker stays closed (the documented
reason above holds).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from gateway.servers.pool import Server

Key = tuple[str, str]


@dataclass
class _Pair:
    failures: int = 0  # pair-specific failures in a row
    quarantined_until: float = 0.0  # 0: not quarantined
    cooldown: float = 0.0
    probing: bool = False
    quarantines: int = 0
    servers: tuple[Server, ...] = ()  # the pair's servers, when the caller named them
    comebacks: int = 0  # their comebacks when quarantined: a later one ends the quarantine


class PairHealth:
    def __init__(self, threshold: int = 3, cooldown: float = 10.0, max_cooldown: float = 120.0,
                 window: float = 30.0, clock=time.monotonic) -> None:
        self.threshold = threshold
        self.base_cooldown = cooldown
        self.max_cooldown = max_cooldown
        self.window = window
        self._clock = clock
        self._pairs: dict[Key, _Pair] = {}
        # url -> partner url -> (last outcome with that partner, when)
        self._partners: dict[str, dict[str, tuple[bool, float]]] = {}

    def _note(self, prefill: str, decode: str, ok: bool, now: float) -> None:
        partners = self._partners
        outcome = (ok, now)
        known = partners.get(prefill)
        if known is None:
            known = partners[prefill] = {}
        known[decode] = outcome
        known = partners.get(decode)
        if known is None:
            known = partners[decode] = {}
        known[prefill] = outcome

    def record_success(self, prefill: str, decode: str) -> None:
        self._note(prefill, decode, True, self._clock())
        if self._pairs:  # healthy again (a probe succeeded)
            self._pairs.pop((prefill, decode), None)

    def record_failure(self, prefill: str, decode: str,
                       servers: tuple[Server, Server] | None = None) -> bool:
        """A failed attempt of the pair; True when it is the pair's fault (both servers
        succeed with other partners), so the servers' breakers should not hear of it.
        `servers`: the pair's two servers, whose comebacks end its quarantine."""
        now = self._clock()
        p_works, p_fails = self._elsewhere(prefill, decode, now)
        d_works, d_fails = self._elsewhere(decode, prefill, now)
        specific = (p_works or d_works) and not (p_fails or d_fails)
        self._note(prefill, decode, False, now)
        pair = self._pairs.get((prefill, decode))
        if not specific:
            if pair is not None and pair.probing:  # the probe failed: quarantine again
                self._quarantine(pair, now)
            return False
        if pair is None:
            pair = self._pairs[(prefill, decode)] = _Pair()
        if servers is not None:
            pair.servers = servers
        pair.failures += 1
        if pair.probing or pair.failures >= self.threshold:
            self._quarantine(pair, now)
        return True

    def _quarantine(self, pair: _Pair, now: float) -> None:
        pair.cooldown = min(self.max_cooldown, pair.cooldown * 2 if pair.probing
                            else self.base_cooldown)
        pair.quarantined_until = now + pair.cooldown
        pair.probing = False
        pair.quarantines += 1
        pair.comebacks = _comebacks(pair)

    def _elsewhere(self, url: str, partner: str, now: float) -> tuple[bool, bool]:
        """Whether the server's last outcome with some other partner, recently, was a
        success; and whether one was a failure."""
        works = fails = False
        for other, (ok, at) in self._partners.get(url, {}).items():
            if other != partner and now - at <= self.window:
                works, fails = works or ok, fails or not ok
        return works, fails

    def blocked(self, prefill: str, decode: str) -> bool:
        """Should the scheduler avoid pairing these two now? (No side effect.)"""
        if not self._pairs:  # (asked for every decode on every pick)
            return False
        pair = self._pairs.get((prefill, decode))
        if pair is None or not pair.quarantined_until:
            return False
        return pair.probing or (self._clock() < pair.quarantined_until
                                and _comebacks(pair) == pair.comebacks)

    def partners(self, prefill: str, decodes: list) -> list:
        """The `decodes` not `blocked` with `prefill`: all of them, the list itself, while no
        pair has failed (every pick asks)."""
        if not self._pairs:
            return decodes
        return [d for d in decodes if not self.blocked(prefill, d.url)]

    def probe(self, prefill: str, decode: str) -> None:
        """The scheduler sends a request through a quarantined pair whose cooldown is over."""
        if not self._pairs:
            return
        pair = self._pairs.get((prefill, decode))
        if pair is not None and pair.quarantined_until and not pair.probing:
            pair.probing = True

    def release_probe(self, prefill: str, decode: str) -> None:
        """The probe ended without a verdict (cancelled): the next request may probe."""
        pair = self._pairs.get((prefill, decode))
        if pair is not None:
            pair.probing = False

    def quarantined(self) -> list[Key]:
        return [key for key, pair in self._pairs.items() if pair.quarantined_until]

    def forget(self, url: str) -> None:
        self._partners.pop(url, None)
        for partners in self._partners.values():
            partners.pop(url, None)
        for key in [k for k in self._pairs if url in k]:
            del self._pairs[key]

    def snapshot(self) -> list[dict]:
        now = self._clock()
        return [{"prefill": p, "decode": d, "failures": pair.failures,
                 "quarantined": bool(pair.quarantined_until),
                 "retry_in": round(max(0.0, pair.quarantined_until - now), 3)
                 if pair.quarantined_until else None,
                 "probing": pair.probing, "quarantines": pair.quarantines}
                for (p, d), pair in self._pairs.items()]


def _comebacks(pair: _Pair) -> int:
    """How often the pair's servers were found back so far (0 when not named)."""
    return sum(server.comebacks for server in pair.servers)
