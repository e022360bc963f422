"""POSIX shared-memory segments shared between the daemon and engines.

The creator of a segment owns its lifetime; a process that only maps one must
keep Python's resource tracker from unlinking it at exit. Both sides use these
helpers, so they live beside the wire protocol, not in the daemon's pools.
"""

from __future__ import annotations

from multiprocessing import resource_tracker, shared_memory
from typing import Optional

_CREATED_HERE: set[str] = set()  # segments this process created (its tracker entry must stay)


def create_shm(nbytes: int, name: Optional[str] = None) -> shared_memory.SharedMemory:
    """A new segment of at least ``nbytes`` owned by this process."""
    shm = shared_memory.SharedMemory(name=name, create=True, size=max(nbytes, 1))
    _CREATED_HERE.add(shm._name)  # type: ignore[attr-defined]  # the tracker's key, not public API
    return shm


def release_shm(shm: shared_memory.SharedMemory, unlink: bool) -> None:
    """Close (and unlink) a segment; a view still held elsewhere keeps the
    mapping alive until it is collected, which must not fail shutdown."""
    if unlink:
        try:
            shm.unlink()
        except FileNotFoundError:
            pass
    try:
        shm.close()
    except BufferError:
        pass


def attach_shm(name: str) -> shared_memory.SharedMemory:
    """Map an existing segment without letting this process's resource
    tracker unlink it at exit (the creator owns its lifetime)."""
    shm = shared_memory.SharedMemory(name=name, create=False)
    if shm._name not in _CREATED_HERE:  # type: ignore[attr-defined]  # the tracker's key, not public API
        try:
            resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]  # (as above)
        except Exception:
            pass
    return shm


__all__ = ["create_shm", "release_shm", "attach_shm"]
