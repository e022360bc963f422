"""Is an engine's process alive, and may a silent engine still write its slots?

An engine reports its pid and its pid namespace. The daemon can judge the pid
only when the engine lives in the daemon's own pid namespace (a container
beside the daemon reports a pid that means nothing here): otherwise heartbeats
alone decide. An engine judged silent whose process may still be running is
*fenced*: its pins and references stay in the table, so the HBM slots it may still be writing
are never handed to another engine, until its process is seen dead (or, when
that cannot be seen, until ``fence_timeout_s`` passed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from kvtier.protocol.runtime import pid_namespace

PID_MAX = 1 << 22  # Linux's largest pid_max: a larger pid names no process


own_pid_namespace = pid_namespace  # this daemon's


def pid_checkable(pid: int, pid_ns: int, own_ns: int) -> bool:
    """Can this daemon judge ``pid`` (a real pid in its own pid namespace)?"""
    return 0 < pid <= PID_MAX and pid_ns != 0 and pid_ns == own_ns


def pid_alive(pid: int) -> bool:
    """Does process ``pid`` exist here? (Only meaningful when ``pid_checkable``.)"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    """Has ``pid`` exited, its parent not yet reaped it? It writes nothing any more, though
    ``kill(pid, 0)`` still finds it (no /proc: judged alive, as before)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2: stat.rfind(b")") + 3] == b"Z"  # the state follows "(comm) "


@dataclass
class Fence:
    """The pins a silent engine held when it was reclaimed, kept in the table."""

    engine_id: str
    pid: Optional[int]  # None: the daemon cannot see this engine's process
    process: tuple[int, int]  # (pid, pid namespace) it registered with: only that process may lift it early
    pins: np.ndarray  # block ids, one entry per pin
    refs: dict[int, int]  # block -> references it held: freed with the pins, so no open block is orphaned
    since: float

    def due(self, now: float, fence_timeout_s: float) -> bool:
        """May the fenced slots go back into circulation?"""
        if self.pid is not None:
            return not pid_alive(self.pid)
        return now - self.since > fence_timeout_s


__all__ = ["PID_MAX", "Fence", "own_pid_namespace", "pid_checkable", "pid_alive"]
