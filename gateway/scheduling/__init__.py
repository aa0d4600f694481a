"""Scheduling: candidate servers of the request's model -> a (prefill, decode) pair."""
