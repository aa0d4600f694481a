"""A seeded schedule of overlapping faults: a pure function of (seed, length, servers).

Every fault kind the soak knows is drawn in turn (a fresh shuffle per round), so a schedule
of at least `len(KINDS)` faults exercises all of them. A fault holds one server for its
window (plus a margin after a restart); a server carries one fault at a time, and at least
one server of each role is never faulty, so a healthy prefill-decode pair always exists.
Faults on different servers overlap freely, and a fault often starts on one server right as
another's ends (a server recovering while another breaks). The same arguments always give
the same schedule: a failing seed replays it exactly.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

KINDS = ("error_storm", "flap", "hang", "freeze", "withhold_kv", "stall", "truncate", "kill")
PREFILL_ONLY = frozenset({"withhold_kv"})
RESTART_MARGIN = 8.0  # a restarted sim takes seconds to serve again: keep it out of new faults
END_MARGIN = 3.0  # every fault ends this long before the traffic stops


@dataclass(frozen=True)
class Fault:
    """One fault on one server from `start` to `end` (seconds from the start of traffic)."""

    kind: str
    server: str
    start: float
    end: float
    detail: str = ""

    def label(self) -> str:
        extra = f" {self.detail}" if self.detail else ""
        return f"{self.kind}@{self.server} [{self.start:.1f}-{self.end:.1f}s{extra}]"


@dataclass(frozen=True)
class Action:
    """One step the executor takes at `at`: `op` is knobs, kill, restart, freeze or thaw."""

    at: float
    server: str
    op: str
    knobs: tuple[tuple[str, object], ...] = ()


@dataclass(frozen=True)
class Schedule:
    seed: int
    seconds: float
    faults: tuple[Fault, ...]
    actions: tuple[Action, ...]  # sorted by time

    def active(self, start: float, end: float, linger: float = 0.0) -> list[Fault]:
        """Faults whose window (extended by `linger` after it ends) meets [start, end]."""
        return [f for f in self.faults if f.start <= end and f.end + linger >= start]


def make_schedule(seed: int, seconds: float, prefills: Sequence[str],
                  decodes: Sequence[str]) -> Schedule:
    """The faults and executor steps of one soak run."""
    rng = random.Random(seed)
    roles = {"prefill": list(prefills), "decode": list(decodes)}
    free_at = {name: 0.0 for names in roles.values() for name in names}
    faults: list[Fault] = []
    order: list[str] = []
    t = rng.uniform(1.0, 3.0)
    while t < seconds - END_MARGIN - 2.0:
        if not order:
            order = list(KINDS)
            rng.shuffle(order)
        placed = _place(rng, order, roles, free_at, t)
        if placed is None:  # every spare server is busy: try again a little later
            t += 0.5
            continue
        kind, server = placed
        order.remove(kind)
        fault = _draw_fault(rng, kind, server, t, seconds - END_MARGIN)
        faults.append(fault)
        free_at[server] = fault.end + (RESTART_MARGIN if kind == "kill" else 0.0)
        back_to_back = rng.random() < 0.35
        t += rng.uniform(0.0, 0.5) if back_to_back else rng.uniform(1.0, 4.0)
    actions = sorted((a for f in faults for a in _actions(rng, f)), key=_ends_first)
    return Schedule(seed, seconds, tuple(faults), tuple(actions))


def _ends_first(action: Action) -> tuple[float, bool]:
    """Order by time; at one instant, a fault ending goes before one starting (back to back
    on two servers of a role must not mean both faulty for a moment)."""
    ends = action.op in ("thaw", "restart") or (
        action.op == "knobs" and not any(value for _, value in action.knobs))
    return action.at, not ends


def _place(rng: random.Random, order: list[str], roles: dict[str, list[str]],
           free_at: dict[str, float], t: float) -> tuple[str, str] | None:
    """The first kind of the round that has a server free now, and that server."""
    for kind in order:
        server = _pick_server(rng, kind, roles, free_at, t)
        if server is not None:
            return kind, server
    return None


def _pick_server(rng: random.Random, kind: str, roles: dict[str, list[str]],
                 free_at: dict[str, float], t: float) -> str | None:
    """A free server of a role that keeps one server untouched, or None."""
    wanted = ["prefill"] if kind in PREFILL_ONLY else ["decode", "prefill"]
    rng.shuffle(wanted)
    for role in wanted:
        names = roles[role]
        busy = [n for n in names if free_at[n] > t]
        if len(busy) + 1 >= len(names):
            continue  # one more would leave no server of this role healthy
        return rng.choice([n for n in names if free_at[n] <= t])
    return None


def _draw_fault(rng: random.Random, kind: str, server: str, start: float,
                last_end: float) -> Fault:
    length = rng.uniform(6.0, 12.0) if kind == "flap" else rng.uniform(3.0, 9.0)
    end = min(start + length, last_end)
    detail = ""
    if kind == "error_storm":
        detail = f"rate={rng.choice((1.0, 1.0, 0.7, 0.4))}"
    elif kind == "truncate":
        detail = f"rate={rng.choice((1.0, 0.6, 0.3))}"
    elif kind == "stall":
        detail = f"after={rng.randint(1, 4)}"
    elif kind == "flap":
        detail = f"period={rng.choice((0.5, 1.0, 2.0, 3.0))}"
    return Fault(kind, server, round(start, 3), round(end, 3), detail)


def _actions(rng: random.Random, fault: Fault) -> list[Action]:
    """The executor's steps for one fault: set it at its start, clear it at its end."""
    s, e, name = fault.start, fault.end, fault.server
    value = fault.detail.split("=", 1)[1] if fault.detail else ""

    def knobs(at: float, **values: object) -> Action:
        return Action(round(at, 3), name, "knobs", tuple(values.items()))
    if fault.kind == "kill":
        return [Action(s, name, "kill"), Action(e, name, "restart")]
    if fault.kind == "freeze":
        return [Action(s, name, "freeze"), Action(e, name, "thaw")]
    if fault.kind == "flap":
        period, steps, at, down = float(value), [], s, True
        while at < e:
            steps.append(knobs(at, health_fail=down))
            at += period * rng.uniform(0.5, 1.5)
            down = not down
        return [*steps, knobs(e, health_fail=False)]
    knob, on = _KNOBS[fault.kind]
    setting = type(on)(value) if value else on
    return [knobs(s, **{knob: setting}), knobs(e, **{knob: clear_knobs()[knob]})]


# kind -> (the knob it sets, its value when the fault's detail names none)
_KNOBS: dict[str, tuple[str, object]] = {
    "error_storm": ("error_rate", 1.0), "truncate": ("truncate_rate", 1.0),
    "stall": ("stall_after", 1), "hang": ("hang", True), "withhold_kv": ("withhold_kv", True),
}


def clear_knobs() -> dict[str, object]:
    """The knob values of a server with no fault (what the executor sets at the end)."""
    return {"error_rate": 0, "truncate_rate": 0, "stall_after": 0, "hang": False,
            "withhold_kv": False, "health_fail": False}
