"""What changes while the gateway runs, kept apart from the parts that make it (like
uvicorn's `ServerState`): whether it is shutting down, and its last errors."""

from __future__ import annotations

import time
from collections import deque

from gateway.errors import GatewayError

RECENT_ERRORS = 50


class RuntimeState:
    """Read by the readiness probe and the status page; written by the lifespan (shutdown)
    and by the inference endpoints (errors)."""

    __slots__ = ("shutting_down", "recent_errors")

    def __init__(self, keep: int = RECENT_ERRORS) -> None:
        self.shutting_down = False
        self.recent_errors: deque[dict] = deque(maxlen=keep)

    def note_error(self, err: GatewayError, endpoint: str, request_id: str) -> None:
        """Keep the last errors for the status page (bounded; no request bodies)."""
        self.recent_errors.append({"time": time.time(), "endpoint": endpoint,
                                   "status": err.status, "type": err.error_type,
                                   "message": err.detail[:300],
                                   "request_id": request_id})
