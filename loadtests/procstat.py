"""CPU time and peak memory of a process and all its descendants, read from /proc (Linux)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")
PROC = Path("/proc")


def _stat_fields(pid: int) -> list[str]:
    raw = (PROC / str(pid) / "stat").read_text()
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    return raw[raw.rindex(")") + 2:].split()


def descendants(root: int) -> list[int]:
    """`root` and every live process below it."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int(_stat_fields(int(entry.name))[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def cpu_seconds(root: int) -> float:
    """User + system CPU of the tree, including children it has already reaped."""
    total = 0
    for pid in descendants(root):
        try:
            fields = _stat_fields(pid)
        except OSError:
            continue
        # After the command: state(0) ppid(1) ... utime(11) stime(12) cutime(13) cstime(14).
        total += int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])
    return total / TICKS


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


def busy_per_cpu() -> dict[str, float]:
    """CPU seconds each core (and "all") spent on anything but idle and I/O wait since boot."""
    out = {}
    with open(PROC / "stat") as f:
        for line in f:
            if not line.startswith("cpu"):
                break
            name, *values = line.split()
            fields = [int(v) for v in values]
            # user nice system idle iowait irq softirq steal (guest time is already in user)
            out["all" if name == "cpu" else name] = (sum(fields[:8]) - fields[3]
                                                     - fields[4]) / TICKS
    return out


@dataclass(frozen=True)
class Usage:
    """CPU seconds spent in one measured window, by whom, and per core."""

    proxy: float
    backends: float
    loadgen: float
    other: float  # everything else on the machine: other users' processes, the kernel
    cores: dict[str, float]  # busy seconds per core ("cpu0", "cpu1", ...)


class WindowMeter:
    """`start()` and `stop()` around a window; `stop()` says who used the CPU in it."""

    def __init__(self, proxy_pid: int | None, backend_pids: list[int]) -> None:
        self.proxy_pid = proxy_pid
        self.backend_pids = backend_pids
        self._start: tuple[float, float, float, dict[str, float]] = (0.0, 0.0, 0.0, {})

    def _now(self) -> tuple[float, float, float, dict[str, float]]:
        proxy = cpu_seconds(self.proxy_pid) if self.proxy_pid is not None else 0.0
        backends = sum(cpu_seconds(pid) for pid in self.backend_pids)
        # The load generator is this process alone (its children are the proxy and servers).
        return proxy, backends, time.process_time(), busy_per_cpu()

    def start(self) -> None:
        self._start = self._now()

    def stop(self) -> Usage:
        proxy, backends, loadgen, cores = self._now()
        proxy -= self._start[0]
        backends -= self._start[1]
        loadgen -= self._start[2]
        cores = {name: busy - self._start[3].get(name, 0.0) for name, busy in cores.items()}
        other = max(0.0, cores.pop("all") - proxy - backends - loadgen)
        return Usage(proxy, backends, loadgen, other, cores)


def wait_quiet(max_cores: float, patience: float, sample: float = 1.0) -> float:
    """Wait until the whole machine is busier than `max_cores` no more (at most `patience` s).

    Call it while none of our load runs: what it sees is other people's work and the idle
    servers. Returns the last busy figure, in cores.
    """
    deadline = time.monotonic() + patience
    while True:
        before = busy_per_cpu()["all"]
        time.sleep(sample)
        busy = (busy_per_cpu()["all"] - before) / sample
        if busy <= max_cores or time.monotonic() >= deadline:
            return busy
