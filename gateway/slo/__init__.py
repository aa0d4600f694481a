"""SLO scheduling: a PD latency model learned online, objectives per request, and the
admission gate that refuses early what no pair can serve in time (docs/SCHEDULING.md)."""
