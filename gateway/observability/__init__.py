"""Metrics, usage accounting, the access log, latency history and tracing."""
