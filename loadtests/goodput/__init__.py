"""SLO goodput benchmark: requests per second served within their objectives (run.py)."""
