"""Health of servers and pairs: the background checker, pair health, learned deadlines."""
