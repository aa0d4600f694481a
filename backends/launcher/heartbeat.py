"""How long a crashed SGLang server with a bootstrap server stays down before its restart.

A decode keeps what a prefill's bootstrap server told it (the ZMQ endpoints of the prefill's
ranks) and forgets it only after `SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE` failed checks
in a row, one check every `SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL` seconds (sglang 0.5.23,
`CommonKVManager._start_heartbeat_checker_thread` and `_handle_node_failure`,
disaggregation/common/conn.py). A prefill restarted on the same bootstrap port before then
answers the next check, so the decode never forgets the dead process: it keeps sending its KV
destinations to endpoints nobody listens on, and every transfer from that prefill to that
decode waits until it is aborted. CI met exactly that when the CPU rig's prefill came back
8 s after a SIGKILL. The launcher therefore keeps such a server down until every decode has
missed enough checks, whatever the restart backoff says.
"""

from __future__ import annotations

from collections.abc import Mapping

from backends.launcher.topology import ServerSpec, Topology

INTERVAL_ENV = "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL"
FAILURES_ENV = "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE"
DEFAULT_INTERVAL_S = 5.0  # sglang/srt/environ.py
DEFAULT_FAILURES = 2
MIN_INTERVAL_S = 2.0  # SGLang's own floors (CommonKVManager.__init__, decode mode)
MIN_FAILURES = 1


def forget_after_s(environ: Mapping[str, str]) -> float:
    """Seconds a prefill must stay unreachable for a decode with this environment to drop it:
    `failures` checks `interval` apart, plus one interval for where in its cycle the decode
    was when the prefill died."""
    interval = max(_number(environ, INTERVAL_ENV, DEFAULT_INTERVAL_S, float), MIN_INTERVAL_S)
    failures = max(_number(environ, FAILURES_ENV, DEFAULT_FAILURES, int), MIN_FAILURES)
    return interval * (failures + 1)


def restart_hold_s(topology: Topology, server: ServerSpec, environ: Mapping[str, str]) -> float:
    """The least time between `server`'s death and its restart: what the slowest decode of the
    topology needs to forget it (0 for simulated servers and servers without a bootstrap
    server, which no decode caches)."""
    if topology.backend != "sglang" or server.bootstrap_port is None:
        return 0.0
    decodes = [s for s in topology.servers if s is not server and s.role != "plain"]
    return max((forget_after_s({**environ, **s.env_dict}) for s in decodes), default=0.0)


def _number(environ: Mapping[str, str], name: str, default: float, kind: type) -> float:
    """The variable as SGLang's EnvFloat/EnvInt read it; SGLang fails on a value it cannot
    parse, so such a server never starts and the default is as good as any here."""
    try:
        return kind(environ[name])
    except (KeyError, ValueError):
        return default
