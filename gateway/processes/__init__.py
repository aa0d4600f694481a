"""`--workers N`: the supervisor, the control channel between worker processes, shared state."""
