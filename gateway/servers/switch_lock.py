"""One role switch at a time per gateway: in this process and across its `--workers`.

SGLang leaves serialization to its caller ("the caller must drain ingress and serialize
role-switch requests", managers/tokenizer_control_mixin.py). Two switches at once could each
see the other's server still serving and leave a role empty between them, so the gateway
holds one lock for the whole procedure (drain, wait, prepare, switch, re-register).

Where it lives: in one process, a flag on the event loop; with `--workers N`, an exclusive
`fcntl.flock` on a file beside the shared block's own lock file (the thing the workers
already share), taken without blocking: a second switch is refused (409), never queued
behind a drain that may take minutes. The kernel drops a flock when its holder dies, so a
worker that crashes mid-switch leaves no stale lock. Replicas share neither: the lock does
not reach them (docs/ROLE_SWITCH.md, "Replicas").
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator


class SwitchBusy(Exception):
    """Another switch holds the lock; its description is the message."""


class SwitchLock:
    """Held for one switch; `path` None without `--workers` (this process only)."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self.holder: str | None = None  # what this process is switching now
        self.url: str | None = None  # the server it switches

    @contextlib.contextmanager
    def hold(self, url: str, what: str) -> Iterator[None]:
        """Take the lock to switch `url` (`what` describes it) or raise SwitchBusy at once.
        With workers the holder writes `url` into the lock file, for `switching`."""
        if self.holder is not None:
            raise SwitchBusy(f"another role switch is in progress ({self.holder})")
        fd = None
        if self.path is not None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise SwitchBusy("another role switch is in progress (in another worker "
                                 "process of this gateway)") from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, url.encode(), 0)
        self.holder, self.url = what, url
        try:
            yield
        finally:
            self.holder = self.url = None
            if fd is not None:
                os.ftruncate(fd, 0)
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)

    def switching(self, url: str) -> bool:
        """Whether a switch of `url` runs now, here or in another worker (the admin routes
        refuse to change a server under a switch: the switch would undo their change)."""
        if self.url is not None or self.path is None:
            return self.url == url
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # held: by a switch of which server?
            return os.pread(fd, 4096, 0) == url.encode()
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False
        finally:
            os.close(fd)
