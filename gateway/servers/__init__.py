"""The backend servers: their record and pool, DP ranks, breakers, probes and reported load."""
