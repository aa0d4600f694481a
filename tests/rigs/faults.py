"""A fault-injection rig: simulated SGLang servers and the gateway as real loopback processes.

Everything a fault test needs and nothing more: start the cluster (servers in parallel), break
one server (kill -9, SIGSTOP, live fault knobs), bring it back on the same port, and read what
the gateway says about it (admin API, Prometheus text, /proc figures of its process).
Every wait is a poll with a deadline (`wait_until`); nothing sleeps and hopes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadtests.routing.cluster import SimServer
from tests.procs import HOST, Proc, free_port, python

# Short PD timeouts so a leg whose partner vanished fails in seconds, not minutes.
SIM_ARGS = ("--bootstrap-timeout", "5", "--waiting-timeout", "5",
            "--bootstrap-retries", "3", "--bootstrap-retry-interval", "0.2")
# Detection settings the fault tests run with (defaults are 5 s / 5 s / 10 s).
FAST_DETECTION = ("--health-interval", "0.5", "--health-timeout", "0.5",
                  "--health-failures", "2", "--health-successes", "1",
                  "--breaker-cooldown", "2", "--loads-interval", "0.5")
START_TIMEOUT = 60.0  # generous: the machine has 2 cores and other work runs beside us


def unique_prompt(i: int, tokens: int) -> str:
    """About `tokens` simulator tokens (4 characters each), unique from the start: no two
    such prompts share a cached prefix."""
    head = f"request {i:06d} "
    return head + "x" * (4 * tokens - len(head))


def wait_until(predicate: Callable[[], object], timeout: float, what: str,
               interval: float = 0.05, detail: Callable[[], object] | None = None) -> float:
    """Poll `predicate` until it is truthy; return the seconds it took, or fail naming `what`
    (and `detail()`, the state worth seeing when it did not happen)."""
    started = time.monotonic()
    deadline = started + timeout
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if predicate():
                return time.monotonic() - started
        if time.monotonic() >= deadline:
            seen = f"; {detail()}" if detail is not None else ""
            raise AssertionError(f"not within {timeout:g}s: {what}{seen}")
        time.sleep(interval)


@dataclass
class Server(SimServer):
    """One simulated SGLang server of the rig; `proc` is replaced when it is restarted."""

    name: str = ""
    command: list[str] = field(default_factory=list)
    proc: Proc | None = None
    generation: int = 0

    @property
    def pid(self) -> int:
        return self.proc.popen.pid


@dataclass
class Rig:
    log_dir: Path
    gateway_args: Sequence[str] = ()
    n_prefill: int = 2
    n_decode: int = 2
    sim_args: Sequence[str] = ()
    servers: list[Server] = field(default_factory=list)
    gateway_proc: Proc | None = None
    gateway: str = ""
    admin_headers: dict = field(default_factory=dict)  # e.g. a Bearer admin key
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=10.0))

    # -- life cycle --------------------------------------------------------------------------

    def start(self) -> Rig:
        for role, count in (("prefill", self.n_prefill), ("decode", self.n_decode)):
            for i in range(count):
                boot = free_port() if role == "prefill" else None
                server = Server(role, free_port(), boot, name=f"{role}{i}")
                server.command = server.argv(*SIM_ARGS, *self.sim_args)
                self.servers.append(server)
        for server in self.servers:  # all at once: startup is mostly imports
            server.proc = Proc(server.name, server.command, self.log_dir)
        for server in self.servers:
            server.proc.wait_http(server.url + "/health", START_TIMEOUT)
        port = free_port()
        argv = python("-m", "gateway", "--host", HOST, "--port", str(port))
        for server in self.prefill:
            argv += ["--prefill", server.url, str(server.bootstrap_port)]
        for server in self.decode:
            argv += ["--decode", server.url]
        self.gateway = f"http://{HOST}:{port}"
        self.gateway_proc = Proc("gateway", argv + list(self.gateway_args), self.log_dir)
        self.gateway_proc.wait_http(self.gateway + "/readiness", START_TIMEOUT)
        return self

    def close(self) -> None:
        for server in self.servers:  # a stopped process would sit out SIGTERM's grace
            if server.proc is not None and server.proc.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(server.pid, signal.SIGCONT)
        procs = [self.gateway_proc] + [s.proc for s in self.servers]
        for proc in procs:
            if proc is not None and proc.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.popen.pid, signal.SIGTERM)
        for proc in procs:
            if proc is not None:
                proc.stop()
        self.http.close()

    @property
    def prefill(self) -> list[Server]:
        return [s for s in self.servers if s.role == "prefill"]

    @property
    def decode(self) -> list[Server]:
        return [s for s in self.servers if s.role == "decode"]

    @property
    def gateway_pid(self) -> int:
        return self.gateway_proc.popen.pid

    # -- faults ------------------------------------------------------------------------------

    def kill(self, server: Server) -> float:
        """kill -9 the server; returns the monotonic time of the kill."""
        at = time.monotonic()
        os.kill(server.pid, signal.SIGKILL)
        server.proc.popen.wait(10)
        return at

    def restart(self, server: Server) -> None:
        """Start the server again on the same ports (its log gets a new name)."""
        server.proc.stop()
        server.generation += 1
        server.proc = Proc(f"{server.name}-{server.generation}", server.command, self.log_dir)
        server.proc.wait_http(server.url + "/health", START_TIMEOUT)

    def freeze(self, server: Server) -> float:
        """SIGSTOP: the kernel still accepts connections, nothing is ever answered."""
        at = time.monotonic()
        os.kill(server.pid, signal.SIGSTOP)
        return at

    def thaw(self, server: Server) -> float:
        at = time.monotonic()
        os.kill(server.pid, signal.SIGCONT)
        return at

    def fault(self, server: Server, **knobs: object) -> float:
        self.http.post(server.url + "/sim/faults", json=knobs).raise_for_status()
        return time.monotonic()

    def stats(self, server: Server) -> dict:
        return self.http.get(server.url + "/sim/stats").json()

    # -- what the gateway says ----------------------------------------------------------------

    def snapshots(self) -> dict[str, dict]:
        response = self.http.get(self.gateway + "/admin/servers", headers=self.admin_headers)
        response.raise_for_status()
        return {s["url"]: s for s in response.json()["servers"]}

    def snapshot(self, server: Server) -> dict:
        return self.snapshots()[server.url]

    def usable(self, server: Server) -> bool:
        return self.snapshot(server)["usable"]

    def metrics(self) -> Metrics:
        response = self.http.get(self.gateway + "/metrics")
        response.raise_for_status()
        return Metrics.parse(response.text)

    def in_flight(self) -> int:
        """Requests the gateway still counts on any server."""
        return sum(s["in_flight"] for s in self.snapshots().values())

    # -- the gateway process, from /proc --------------------------------------------------------

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.gateway_pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS in /proc status")

    def sockets(self) -> int:
        return socket_count(self.gateway_pid)

    def hang_up(self) -> None:
        """Close the rig's own kept-alive connections (its scrapes and admin calls), so that
        what stays open to the gateway afterwards is the clients' (the gateway keeps an idle
        connection for --keep-alive-timeout, 75 s by default)."""
        self.http.close()
        self.http = httpx.Client(timeout=10.0)

    def connections(self) -> Counter:
        """The gateway's TCP connections by (peer, state): peer is a server name, `client`
        for connections clients opened to it, or `other` (listening sockets are left out)."""
        gateway_port = int(self.gateway.rsplit(":", 1)[1])
        names = {s.port: s.name for s in self.servers}
        tally: Counter = Counter()
        for local, remote, state in tcp_sockets(self.gateway_pid):
            if state == "LISTEN":
                continue
            peer = "client" if local == gateway_port else names.get(remote, "other")
            tally[peer, state] += 1
        return tally


def socket_inodes(pid: int) -> set[str]:
    """Inodes of the sockets a process holds open (its /proc fd links `socket:[N]`)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            link = os.readlink(fd)
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    return inodes


def socket_count(pid: int) -> int:
    return len(socket_inodes(pid))


TCP_STATES = {"01": "ESTABLISHED", "06": "TIME_WAIT", "08": "CLOSE_WAIT", "0A": "LISTEN"}


def tcp_sockets(pid: int) -> list[tuple[int, int, str]]:
    """(local port, remote port, state) of each IPv4 TCP socket the process holds open."""
    mine = socket_inodes(pid)
    found = []
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[9] in mine:
            local, remote = (int(a.split(":")[1], 16) for a in fields[1:3])
            found.append((local, remote, TCP_STATES.get(fields[3], fields[3])))
    return found


class Metrics:
    """Samples of one /metrics scrape, looked up by name and a subset of labels."""

    def __init__(self, samples: list[tuple[str, dict[str, str], float]]) -> None:
        self.samples = samples

    @classmethod
    def parse(cls, text: str) -> Metrics:
        samples = []
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples.append((sample.name, dict(sample.labels), sample.value))
        return cls(samples)

    def total(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels` (0 if none)."""
        return sum(value for sample, have, value in self.samples
                   if sample == name and all(have.get(k) == v for k, v in labels.items()))

    def value(self, name: str, **labels: str) -> float:
        found = [value for sample, have, value in self.samples
                 if sample == name and all(have.get(k) == v for k, v in labels.items())]
        if len(found) != 1:
            raise AssertionError(f"{len(found)} samples of {name} {labels}")
        return found[0]


@contextlib.contextmanager
def running_rig(log_dir: Path, gateway_args: Sequence[str] = (), n_prefill: int = 2,
                n_decode: int = 2, sim_args: Sequence[str] = ()) -> Iterator[Rig]:
    rig = Rig(log_dir, tuple(gateway_args), n_prefill, n_decode, tuple(sim_args))
    try:
        yield rig.start()
    finally:
        rig.close()
