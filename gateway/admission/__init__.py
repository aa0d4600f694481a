"""Admission: who is calling (auth, tenancy), per-key limits, concurrency slots and the fair queue."""
