"""Errors raised by the launcher.

LauncherError
├── TopologyError     the topology is invalid; nothing was started
└── StartupError      a server crashed or missed its readiness deadline; all were stopped
"""

from __future__ import annotations

from collections.abc import Sequence


class LauncherError(Exception):
    """Base class of every error the launcher raises on purpose."""


class TopologyError(LauncherError):
    """The topology cannot be started; `problems` lists every problem found, not just the first."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = tuple(problems)
        lines = "\n".join(f"  - {problem}" for problem in self.problems)
        super().__init__(f"invalid topology ({len(self.problems)} problem(s)):\n{lines}")


class StartupError(LauncherError):
    """Servers did not all become ready; the launcher stopped everything it had started."""
