"""Faults in pairs on a cluster the gateway launched itself (`--launch`, simulated servers,
the gateway's default flags): a pair quarantined, its prefill killed and restarted, and the
other decode killed as soon as the prefill is back.

What a user expects:
* the quarantine was the dead process's (its transfer sessions died with it), so the prefill's
  restart forgets it (gateway/launch.py) and does not keep the new process from that decode
  for the rest of a cooldown;
* while the other decode is down, that decode, the only one left, serves every request, and
  no client request fails at any step;
* once the killed decode is back, both decodes get traffic again.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest

from tests.procs import HOST, Proc, free_port, python
from tests.rigs.faults import Metrics, wait_until

QUARANTINE = "gateway_pair_quarantined"


def launched_pid(gateway_pid: int, port: int) -> int:
    """The pid of the launched server listening on `port` (its command line says so)."""
    wanted = ["--port", str(port)]
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == gateway_pid and any(argv[i:i + 2] == wanted for i in range(len(argv))):
            return int(entry.name)
    raise AssertionError(f"no launched server on port {port}")


class Cluster:
    """The gateway process and what it says of its launched servers."""

    def __init__(self, proc: Proc, url: str) -> None:
        self.proc, self.url = proc, url
        self.http = httpx.Client(timeout=10)
        servers = self.http.get(url + "/admin/servers").json()["servers"]
        self.prefill = next(s for s in servers if s["role"] == "prefill")
        self.decodes = sorted((s for s in servers if s["role"] == "decode"),
                              key=lambda s: s["url"])

    def generate(self, count: int, tag: str) -> list[int]:
        """`count` requests one after another; their status codes."""
        statuses = []
        for i in range(count):
            body = {"text": f"{tag} {i} " + "word " * 40,
                    "sampling_params": {"max_new_tokens": 4}}
            statuses.append(self.http.post(self.url + "/generate", json=body).status_code)
        return statuses

    def received(self, server: dict) -> int:
        return self.http.get(server["url"] + "/sim/stats").json()["received"]

    def quarantined(self, decode: dict) -> bool:
        metrics = Metrics.parse(self.http.get(self.url + "/metrics").text)
        return metrics.total(QUARANTINE, prefill=self.prefill["url"], decode=decode["url"]) > 0

    def kill(self, server: dict) -> None:
        port = int(server["url"].rsplit(":", 1)[1])
        os.kill(launched_pid(self.proc.popen.pid, port), signal.SIGKILL)

    def ready_again(self, server: dict, times: int) -> bool:
        """Whether the gateway logged `server`'s restart as ready `times` times."""
        return self.proc.log().count(f"server {server['url']} is ready again") >= times


@pytest.fixture
def cluster(tmp_path):
    topology = tmp_path / "topology.yaml"
    topology.write_text(
        f"backend: sim\nprefill: 1\ndecode: 2\nlog_dir: {tmp_path}/servers\n"
        "restart:\n  initial_backoff_s: 0.2\n")
    port = free_port()
    proc = Proc("gateway", python("-m", "gateway", "--launch", "--launch-config", str(topology),
                                  "--host", HOST, "--port", str(port)), tmp_path)
    try:
        url = f"http://{HOST}:{port}"
        proc.wait_http(url + "/readiness", 60)
        cluster = Cluster(proc, url)
        yield cluster
        cluster.http.close()
    finally:
        proc.stop()


@pytest.mark.timeout(120)
def test_a_prefill_restart_forgets_its_quarantine_while_the_other_decode_dies(cluster) -> None:
    broken, other = cluster.decodes
    # the pair (prefill, broken) fails while both servers work with other partners
    cluster.http.post(broken["url"] + "/sim/faults",
                      json={"fail_bootstrap_port": cluster.prefill["bootstrap_port"]})
    statuses = []
    wait_until(lambda: statuses.extend(cluster.generate(4, "pair")) or
               cluster.quarantined(broken), 30, "the broken pair quarantined")
    assert set(statuses) == {200}, statuses  # its failures were retried on the other decode
    cluster.http.post(broken["url"] + "/sim/faults", json={"fail_bootstrap_port": 0})

    cluster.kill(cluster.prefill)
    wait_until(lambda: cluster.ready_again(cluster.prefill, 1), 30, "the prefill's restart ready")
    # within the pair's 10 s cooldown, that decode is the prefill's partner again
    assert not cluster.quarantined(broken), "the restart kept the old process's quarantine"

    # the second fault: the other decode dies as the prefill comes back
    before = cluster.received(broken)
    cluster.kill(other)
    assert set(cluster.generate(20, "alone")) == {200}
    wait_until(lambda: cluster.ready_again(other, 1), 30, "the other decode's restart ready")
    # the only decode left served them; the killed one only once restarted (0.2 s backoff: on
    # a loaded machine it is back before the last of the 20, its count started again at 0)
    assert cluster.received(broken) - before + cluster.received(other) == 20

    counts = [cluster.received(d) for d in (broken, other)]
    statuses = []
    wait_until(lambda: statuses.extend(cluster.generate(10, "both")) or all(
        cluster.received(d) > n for d, n in zip((broken, other), counts, strict=True)),
        30, "both decodes served again")
    assert set(statuses) == {200}, statuses
