"""Counters for tests: what this sim received and how each item ended.

`requests` counts HTTP requests per endpoint; the outcome counters count
items (a batch of 3 counts 3): completed, failed (an error answer),
cancelled (the client went away first), aborted (POST /abort_request).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from typing import Any

OUTCOMES = ("completed", "failed", "cancelled", "aborted")
_RECENT_ROOMS = 1000
TRACE_HEADERS = (b"traceparent", b"tracestate")  # observability/trace.py's TRACE_HEADERS


class SimStats:
    def __init__(self) -> None:
        self.started = time.time()
        self.reset()

    def reset(self) -> None:
        self.requests: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter({k: 0 for k in OUTCOMES})
        self.flush_count = 0
        self.rooms: deque[dict[str, Any]] = deque(maxlen=_RECENT_ROOMS)
        self.traces: deque[dict[str, Any]] = deque(maxlen=_RECENT_ROOMS)
        self.priorities: Counter[str] = Counter()  # requests by `priority` sent ("None")
        self.faults_applied: Counter[str] = Counter()  # answers a fault knob changed, by kind
        self.rooms_reused = 0  # a decode room this sim already held, offered again

    def faulted(self, kind: str) -> None:
        self.faults_applied[kind] += 1

    def received(self, endpoint: str) -> None:
        self.requests[endpoint] += 1

    def record(self, endpoint: str, rid: str, room: int | None, outcome: str,
               reason: str | None) -> None:
        self.outcomes[outcome] += 1
        if room is not None:
            self.rooms.append({"room": room, "rid": rid, "endpoint": endpoint,
                               "outcome": outcome, "reason": reason, "ts": time.time()})

    def traced(self, endpoint: str, rids: list[str], headers: list[tuple[bytes, bytes]]) -> None:
        """The trace headers one generation request carried (with --enable-trace).

        mirrors extract_trace_headers (observability/trace.py) as
        TokenizerManager._init_req_state calls it: {h: headers[h] for h in TRACE_HEADERS}."""
        found = {name.decode(): value.decode("latin-1") for name, value in headers
                 if name in TRACE_HEADERS}
        self.traces.append({"endpoint": endpoint, "rids": rids, "headers": found})

    def snapshot(self, mode: str, in_flight: int, extra: dict[str, Any]) -> dict[str, Any]:
        return {
            "mode": mode,
            "uptime_s": round(time.time() - self.started, 3),
            "requests": dict(self.requests),
            "received": sum(self.requests.values()),
            **{k: self.outcomes[k] for k in OUTCOMES},
            "in_flight": in_flight,
            "flush_count": self.flush_count,
            "rooms": list(self.rooms),
            "traces": list(self.traces),
            "priorities": dict(self.priorities),
            "faults_applied": dict(self.faults_applied),
            **extra,
        }
