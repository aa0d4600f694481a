"""HTTP handlers: inference (pure ASGI, the hot path), info/health, and admin."""
