"""Fault injection for I/O: the one place a fake is allowed (a failing disk)."""

from __future__ import annotations

import errno
from concurrent.futures import Future
from typing import Any, Sequence

import numpy as np


class FaultyBackend:
    """Wraps a real backend; fails chosen calls the way real disks do."""

    def __init__(self, inner: Any, fail_writes: int = 0, fail_reads: int = 0,
                 mode: str = "enospc", corrupt_reads: int = 0) -> None:
        self.inner = inner
        self.name = inner.name
        self.fail_writes = fail_writes
        self.fail_reads = fail_reads
        self.corrupt_reads = corrupt_reads
        self.mode = mode

    def open(self, path: str, size: int) -> Any:
        return self.inner.open(path, size)

    def _fail(self) -> "Future[int]":
        f: Future[int] = Future()
        if self.mode == "enospc":
            f.set_exception(OSError(errno.ENOSPC, "No space left on device"))
        elif self.mode == "eio":
            f.set_exception(OSError(errno.EIO, "Input/output error"))
        else:
            from kvtier.tiers.types import TierError
            f.set_exception(TierError("short write: 4096 of 16384 bytes"))
        return f

    def pwrite(self, handle: Any, buffers: Sequence[Any], offset: int) -> "Future[int]":
        if self.fail_writes > 0:
            self.fail_writes -= 1
            if self.mode == "short":  # a real partial write, then the error
                self.inner.pwrite(handle, [buffers[0]], offset).result()
            return self._fail()
        return self.inner.pwrite(handle, buffers, offset)

    def pread(self, handle: Any, buffers: Sequence[Any], offset: int) -> "Future[int]":
        if self.fail_reads > 0:
            self.fail_reads -= 1
            return self._fail()
        fut = self.inner.pread(handle, buffers, offset)
        if self.corrupt_reads > 0:
            self.corrupt_reads -= 1
            fut.result()
            buf = buffers[-1]
            assert isinstance(buf, np.ndarray)
            buf.reshape(-1)[17] ^= 0xFF  # a flipped bit on the way back
        return fut

    def fsync(self, handle: Any) -> None:
        self.inner.fsync(handle)

    def close(self, handle: Any) -> None:
        self.inner.close(handle)

    def shutdown(self) -> None:
        self.inner.shutdown()
