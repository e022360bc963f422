"""Exclusive locks on the directories a daemon owns (its runtime dir and its NVMe dir).

Two daemons on one runtime dir would delete each other's sockets; two on one
NVMe dir would overwrite each other's slots. Each daemon holds an ``flock`` on
a lock file in each directory for its whole life; the kernel drops it when the
process dies, so a crashed daemon never blocks the next one.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_FILE = ".kvtier.lock"


class DirInUse(RuntimeError):
    """Another live daemon holds this directory."""


class DirLock:
    def __init__(self, directory: "str | Path", what: str) -> None:
        self.path = Path(directory) / LOCK_FILE
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self.fd)
            who = "this process already" if holder == str(os.getpid()) else f"another kvtier daemon (pid {holder})"
            raise DirInUse(f"{who} holds the {what} {directory}") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # the lock goes with the descriptor; the file stays (harmless, reused)
            self.fd = -1


__all__ = ["DirLock", "DirInUse", "LOCK_FILE"]
