"""How hard each role is pressed, against the latency objectives, and how many servers of each
it needs: the rebalancer's input (rebalance.py) and `gateway_desired_servers`.

A pressure is a number where 1.0 means "at its limit":

* prefill, the larger of
  - its busy share: the time it spent prefilling over the wall time between two `/v1/loads`
    snapshots (SGLang's cumulative `total_prefill_busy_us`, Scheduler._record_step_counters);
  - its queue: the uncached prompt tokens waiting there (`num_waiting_uncached_tokens`) over
    its measured prefill speed (gateway/slo/model.py `prefill_speed`), against half the TTFT
    objective (the other half is left to the prompt's own compute, the KV transfer and the
    decode's admission). The latency model's `predicted_wait` is not used as is: it counts
    this gateway's requests still open on the prefill, and a PD prefill leg stays open until
    its KV has left, so under long outputs it would read a queue that is not there;
* decode, the largest of its batch slots in use (running and waiting over
  `max_running_requests`) and its KV pool in use (`token_usage`); for the role, also the
  mean inter-token gap the gateway streamed over the last interval against the ITL objective.

Each signal is a mean over the role's serving servers (the scheduler spreads the load, so the
mean is what one more or one fewer server changes); the role's pressure is the strongest. A server with no fresh snapshot adds
nothing but its count.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from gateway.servers.pool import Server
from gateway.slo.model import fresh, prefill_speed

TARGET = 0.75  # the pressure a role is sized for: it needs ceil(n * pressure / TARGET)
WAIT_SHARE = 0.5  # of the TTFT objective the prefill queue may take


@dataclass(frozen=True, slots=True)
class RolePressure:
    """One role's pressure, its serving servers and the signal that set it. `load` is the
    part that spreads over the servers (all of it but the ITL: a step has a fixed cost that
    one more decode does not divide), the part a change of count is projected with."""

    value: float
    servers: int
    signal: str  # "busy", "queue", "slots", "kv", "itl" or "idle"
    load: float = -1.0  # -1: the same as value

    @property
    def spread(self) -> float:
        return self.value if self.load < 0 else self.load

    def needed(self, minimum: int) -> int:
        """Servers this role needs to stand at TARGET (never below `minimum`); one more
        than it has while the ITL alone is over its objective."""
        if self.servers == 0:
            return minimum
        count = math.ceil(self.servers * self.spread / TARGET - 1e-9)
        if self.signal == "itl" and self.value >= 1.0:
            count = max(count, self.servers + 1)
        return max(minimum, count)

    def without_one(self) -> float:
        """The load if one server left (the same work over one fewer); inf while the role
        is over an objective already (the ITL: fewer decodes cannot make it shorter)."""
        if self.servers <= 1 or self.value >= 1.0:
            return math.inf
        return self.spread * self.servers / (self.servers - 1)


@dataclass(frozen=True, slots=True)
class Pressure:
    prefill: RolePressure
    decode: RolePressure
    at: float

    def of(self, role: str) -> RolePressure:
        return self.prefill if role == "prefill" else self.decode

    def describe(self) -> str:
        return (f"prefill {self.prefill.value:.2f} ({self.prefill.signal}, "
                f"{self.prefill.servers} servers), decode {self.decode.value:.2f} "
                f"({self.decode.signal}, {self.decode.servers} servers)")


class PressureGauge:
    """Turns the pool's load figures into pressures; remembers the previous busy counters of
    each prefill and the previous ITL sum, so each reading covers the interval since."""

    def __init__(self, ttft_s: float, itl_s: float) -> None:
        self.ttft_s = ttft_s
        self.itl_s = itl_s
        self._busy: dict[str, tuple[int, float]] = {}  # url -> (busy us, snapshot time)
        self._busy_share: dict[str, float] = {}
        self._itl: tuple[float, float] | None = None  # (sum, count) at the last reading

    def measure(self, servers: list[Server], itl_totals: tuple[float, float],
                now: float | None = None) -> Pressure:
        """The pressures of one model's servers now; `itl_totals` is the gateway's
        cumulative (sum, count) of streamed inter-token gaps."""
        now = time.monotonic() if now is None else now
        serving = [s for s in servers if s.serving]
        prefill = self._prefill([s for s in serving if s.role == "prefill"], now)
        decode = self._decode([s for s in serving if s.role == "decode"], itl_totals, now)
        present = {s.url for s in servers}
        for url in [u for u in self._busy if u not in present]:
            del self._busy[url]
            self._busy_share.pop(url, None)
        return Pressure(prefill, decode, now)

    def _prefill(self, servers: list[Server], now: float) -> RolePressure:
        busy = queue = 0.0
        for server in servers:
            if not fresh(server, now):
                continue
            busy += self._busy_of(server)
            wait = server.load.waiting_uncached_tokens / prefill_speed(server)
            queue += wait / (WAIT_SHARE * self.ttft_s)
        return _role(len(servers), {"busy": busy, "queue": queue})

    def _busy_of(self, server: Server) -> float:
        """The share of the time between its last two snapshots it spent prefilling."""
        load = server.load
        before = self._busy.get(server.url)
        if before is None or load.updated_at > before[1]:
            self._busy[server.url] = (load.prefill_busy_us, load.updated_at)
            if before is not None and load.prefill_busy_us >= before[0]:
                spent = (load.prefill_busy_us - before[0]) / 1e6
                self._busy_share[server.url] = min(1.0, spent / (load.updated_at - before[1]))
        return self._busy_share.get(server.url, 0.0)

    def _decode(self, servers: list[Server], itl_totals: tuple[float, float],
                now: float) -> RolePressure:
        slots = kv = 0.0
        for server in servers:
            if not fresh(server, now):
                continue
            load = server.load
            if load.max_running_requests > 0:
                slots += (load.running + load.waiting) / load.max_running_requests
            kv += load.token_usage
        sums = _role(len(servers), {"slots": slots, "kv": kv})
        itl = self._itl_ratio(itl_totals)
        if servers and itl > sums.value:
            return RolePressure(itl, len(servers), "itl", sums.value)
        return sums

    def _itl_ratio(self, totals: tuple[float, float]) -> float:
        """Mean streamed gap since the last reading over the ITL objective (0: none)."""
        before, self._itl = self._itl, totals
        if before is None or totals[1] <= before[1]:
            return 0.0
        return (totals[0] - before[0]) / (totals[1] - before[1]) / self.itl_s


def _role(servers: int, sums: dict[str, float]) -> RolePressure:
    """The mean of the strongest signal over the role's servers."""
    if servers == 0:
        return RolePressure(0.0, 0, "idle")
    signal, total = max(sums.items(), key=lambda item: item[1])
    if total <= 0:
        return RolePressure(0.0, servers, "idle")
    return RolePressure(total / servers, servers, signal)
