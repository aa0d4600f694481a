"""The shifting-workload benchmark of automatic rebalancing (docs/BENCHMARKS.md, "Rebalancing")."""
