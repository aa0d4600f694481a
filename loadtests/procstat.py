"""CPU time and peak memory of a process and all its descendants, read from /proc (Linux)."""

from __future__ import annotations

import os
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


class CpuMeter:
    """`start()` and `stop()` around a window; `stop()` returns the tree's CPU seconds in it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._start = 0.0

    def start(self) -> None:
        self._start = cpu_seconds(self.pid)

    def stop(self) -> float:
        return cpu_seconds(self.pid) - self._start
