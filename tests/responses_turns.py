"""A Responses turn begun in one call, as the endpoint begins it in two (gateway/responses/
turns.py: prepared, then started at dispatch): for tests that drive the service alone."""

from __future__ import annotations

from gateway.responses import turns
from gateway.responses.service import Responses, Turn


async def begin(responses: Responses, tenant: str, raw: bytes | bytearray) -> Turn:
    """The turn prepared and started at once: its body checked, its history expanded, its
    in_progress record written (when kept) and running here."""
    turn, placeholder = await turns.prepare(responses, tenant, raw)
    await turns.start(responses, turn, placeholder)
    return turn
