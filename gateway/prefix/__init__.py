"""Prefix-cache knowledge: the approximate prefix tree, the exact KV-event index, placement."""
