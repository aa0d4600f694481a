"""Dispatch: the attempt loop, one PD attempt's two legs, stream relay and failover, n > 1, rooms."""
