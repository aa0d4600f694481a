"""CPU time and peak memory of a process and all its descendants, read from /proc (Linux)."""

from __future__ import annotations

import os
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


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent on anything but idle and I/O wait since boot."""
    with open(PROC / "stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal (guest time is already in user)
    return (sum(fields[:8]) - fields[3] - fields[4]) / TICKS


@dataclass(frozen=True)
class Usage:
    """CPU seconds spent in one measured window, by whom."""

    proxy: float
    backends: float
    loadgen: float
    other: float  # everything else on the machine: other users' processes, the kernel


class WindowMeter:
    """`start()` and `stop()` around a window; `stop()` says who used the CPU in it."""

    def __init__(self, proxy_pid: int | None, backend_pids: list[int]) -> None:
        self.proxy_pid = proxy_pid
        self.backend_pids = backend_pids
        self._start = (0.0, 0.0, 0.0, 0.0)

    def _now(self) -> tuple[float, float, float, float]:
        proxy = cpu_seconds(self.proxy_pid) if self.proxy_pid is not None else 0.0
        backends = sum(cpu_seconds(pid) for pid in self.backend_pids)
        return proxy, backends, cpu_seconds(os.getpid()), machine_busy_seconds()

    def start(self) -> None:
        self._start = self._now()

    def stop(self) -> Usage:
        proxy, backends, loadgen, busy = (b - a for a, b in zip(self._start, self._now(),
                                                                strict=True))
        return Usage(proxy, backends, loadgen, max(0.0, busy - proxy - backends - loadgen))
