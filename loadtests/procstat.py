"""CPU time and peak memory of a process and all its descendants, read from /proc (Linux)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")
PROC = Path("/proc")


def _stat_fields(pid: int) -> list[str]:
    raw = (PROC / str(pid) / "stat").read_text()
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    return raw[raw.rindex(")") + 2:].split()


def process_tree() -> dict[int, list[int]]:
    """Parent pid -> its live children, from one pass over /proc."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int(_stat_fields(int(entry.name))[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def descendants(root: int, tree: dict[int, list[int]] | None = None) -> list[int]:
    """`root` and every live process below it (in `tree`, else read now)."""
    children = process_tree() if tree is None else tree
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def cpu_by_process(root: int, tree: dict[int, list[int]] | None = None) -> dict[int, float]:
    """User + system CPU of each process of the tree (with the children it has reaped)."""
    out = {}
    for pid in descendants(root, tree):
        try:
            fields = _stat_fields(pid)
        except OSError:
            continue
        # After the command: state(0) ppid(1) ... utime(11) stime(12) cutime(13) cstime(14).
        ticks = int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])
        out[pid] = ticks / TICKS
    return out


def cpu_seconds(root: int, tree: dict[int, list[int]] | None = None) -> float:
    """User + system CPU of the tree, including children it has already reaped."""
    return sum(cpu_by_process(root, tree).values())


def peak_rss_mb(root: int) -> float:
    """Sum over the tree of each process's high-water resident set (VmHWM)."""
    total_kb = 0
    for pid in descendants(root):
        try:
            status = (PROC / str(pid) / "status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                total_kb += int(line.split()[1])
                break
    return total_kb / 1024


def busy_per_cpu() -> dict[str, tuple[float, float]]:
    """Per core (and "all"): CPU seconds since boot (busy, spent in processes).

    Busy is everything but idle and I/O wait; "in processes" leaves out interrupts and
    softirqs too (loopback networking of our own traffic runs there, and no process is
    charged for it).
    """
    out = {}
    with open(PROC / "stat") as f:
        for line in f:
            if not line.startswith("cpu"):
                break
            name, *values = line.split()
            # user nice system idle iowait irq softirq steal (guest time is already in user)
            user, nice, system, _idle, _iowait, irq, softirq, steal = (
                int(v) for v in values[:8])
            tasks = user + nice + system + steal
            out["all" if name == "cpu" else name] = ((tasks + irq + softirq) / TICKS,
                                                     tasks / TICKS)
    return out


@dataclass(frozen=True)
class Usage:
    """CPU seconds spent in one measured window, by whom, and per core."""

    proxy: float
    backends: float
    loadgen: float
    other: float  # CPU of all other processes: other people's work on the machine
    cores: dict[str, float]  # busy seconds per core ("cpu0", "cpu1", ...)
    proxy_procs: dict[int, float] = field(default_factory=dict)  # the proxy's, per process


class WindowMeter:
    """`start()` and `stop()` around a window; `stop()` says who used the CPU in it.

    The load generator is this process, or the processes `loadgen_pids` when it runs in
    several (loadtests/loadgen.py)."""

    def __init__(self, proxy_pid: int | None, backend_pids: list[int],
                 loadgen_pids: list[int] | None = None) -> None:
        self.proxy_pid = proxy_pid
        self.backend_pids = backend_pids
        self.loadgen_pids = loadgen_pids
        self._start: tuple[dict[int, float], float, float, dict] = ({}, 0.0, 0.0, {})

    def _now(self) -> tuple[dict[int, float], float, float, dict]:
        tree = process_tree()
        proxy = cpu_by_process(self.proxy_pid, tree) if self.proxy_pid is not None else {}
        backends = sum(cpu_seconds(pid, tree) for pid in self.backend_pids)
        if self.loadgen_pids is None:  # this process alone (its children: proxy and servers)
            loadgen = time.process_time()
        else:
            loadgen = sum(cpu_seconds(pid, tree) for pid in self.loadgen_pids)
        return proxy, backends, loadgen, busy_per_cpu()

    def start(self) -> None:
        self._start = self._now()

    def stop(self) -> Usage:
        procs, backends, loadgen, cores = self._now()
        before_procs = self._start[0]
        per_proc = {pid: cpu - before_procs.get(pid, 0.0) for pid, cpu in procs.items()}
        proxy = sum(procs.values()) - sum(before_procs.values())
        backends -= self._start[1]
        loadgen -= self._start[2]
        before = self._start[3]
        tasks = cores["all"][1] - before["all"][1]
        busy = {name: now[0] - before[name][0] for name, now in cores.items()
                if name != "all" and name in before}
        other = max(0.0, tasks - proxy - backends - loadgen)
        return Usage(proxy, backends, loadgen, other, busy, per_proc)


def wait_quiet(max_cores: float, patience: float, sample: float = 1.0) -> float:
    """Wait until the whole machine is busier than `max_cores` no more (at most `patience` s).

    Call it while none of our load runs: what it sees is other people's work and the idle
    servers. Returns the last busy figure, in cores.
    """
    deadline = time.monotonic() + patience
    while True:
        before = busy_per_cpu()["all"][1]
        time.sleep(sample)
        busy = (busy_per_cpu()["all"][1] - before) / sample
        if busy <= max_cores or time.monotonic() >= deadline:
            return busy
