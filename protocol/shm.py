"""POSIX shared-memory segments shared between the daemon and engines.

The creator of a segment owns its lifetime; a process that only maps one must
keep Python's resource tracker from unlinking it at exit. Both sides use these
helpers, so they live beside the wire protocol, not in the daemon's pools.

Segments are sparse until touched: a pool larger than /dev/shm would be created
fine and then SIGBUS whichever process first touches a page past the limit.
``create_shm`` therefore reserves every page up front, so a pool that does not
fit fails where it is created (ENOSPC), not later in an engine.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import threading
from multiprocessing import resource_tracker, shared_memory
from typing import Callable, Iterator, Optional

SHM_DIR = "/dev/shm"  # where Linux shows POSIX shared memory (for messages and free-space reports)
_CREATED_HERE: set[str] = set()  # segments this process created (its tracker entry must stay)
_LOCAL = threading.local()  # per thread: the open ``unlink_on_error`` blocks, innermost last


def _scopes() -> list[list[shared_memory.SharedMemory]]:
    if not hasattr(_LOCAL, "scopes"):
        _LOCAL.scopes = []
    return _LOCAL.scopes


def segment_prefix(pid: int) -> str:
    """Name prefix of the segments process ``pid`` creates, so an operator (or a
    test) can tell whose segment a /dev/shm entry is."""
    return f"kvtier_{pid}_"


def _shm_free() -> str:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return "unknown"
    return f"{st.f_bavail * st.f_frsize} bytes"


def _reserve(shm: shared_memory.SharedMemory, size: int) -> None:
    """Allocate the segment's pages now (ENOSPC here instead of SIGBUS on first touch)."""
    if not hasattr(os, "posix_fallocate"):
        return  # not Linux: no /dev/shm size limit to run into
    fd = shm._fd  # type: ignore[attr-defined]  # SharedMemory keeps its descriptor private; no public accessor
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        why = e.strerror or os.strerror(e.errno or errno.EIO)
        raise OSError(e.errno, f"{why} (reserving {size} bytes of shared memory; {SHM_DIR} has "
                               f"{_shm_free()} free)", os.path.join(SHM_DIR, shm.name)) from None


def create_shm(nbytes: int, name: Optional[str] = None,
               prepare: Optional[Callable[[shared_memory.SharedMemory], None]] = None) -> shared_memory.SharedMemory:
    """A new segment of at least ``nbytes`` owned by this process, its pages reserved.

    ``prepare`` runs on the mapped segment before its pages exist (a NUMA binding
    must: it only steers pages allocated after it). If it or the reservation fails,
    the half-made segment is unlinked; the OSError (ENOSPC when /dev/shm is too
    small) names the segment."""
    size = max(nbytes, 1)
    name = name or f"{segment_prefix(os.getpid())}{secrets.token_hex(4)}"
    shm = shared_memory.SharedMemory(name=name, create=True, size=size)
    try:
        if prepare is not None:
            prepare(shm)
        _reserve(shm, size)
    except BaseException:
        release_shm(shm, unlink=True)
        raise
    _CREATED_HERE.add(shm._name)  # type: ignore[attr-defined]  # the tracker's key, not public API
    scopes = _scopes()
    if scopes:
        scopes[-1].append(shm)
    return shm


@contextlib.contextmanager
def unlink_on_error() -> Iterator[None]:
    """Segments created inside the block are unlinked if it raises: a half-built
    owner (pools built, a later step failed) is never closed by anyone else, and
    an unlinked-by-nobody segment holds its memory until reboot. Per thread."""
    scopes = _scopes()
    made: list[shared_memory.SharedMemory] = []
    scopes.append(made)
    try:
        yield
    except BaseException:
        for shm in made:
            release_shm(shm, unlink=True)
        raise
    else:
        if len(scopes) > 1:
            scopes[-2].extend(made)  # an enclosing block answers for them too
    finally:
        scopes.pop()


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


__all__ = ["create_shm", "release_shm", "attach_shm", "segment_prefix", "unlink_on_error"]
