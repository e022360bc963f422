"""Fault injection for I/O: a failing or slow disk, for resilience tests and drills.

``FaultyBackend`` wraps a real backend and fails, corrupts or delays chosen
calls the way real disks do. The daemon builds it for ``io_backend = "faulty"``
from ``KVTIER_FAULTS`` (e.g. ``"delay_s=0.01,fail_reads=2,mode=eio"``); it is
never chosen by ``auto``.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from concurrent.futures import Future
from functools import partial
from typing import Any, Callable, Optional, Sequence

import numpy as np

from .futures import Then, followed, gather, then_check
from .pools import ALIGN


class FaultyBackend:
    """Wraps a real backend; fails chosen calls the way real disks do."""

    def __init__(self, inner: Any, fail_writes: int = 0, fail_reads: int = 0,
                 mode: str = "enospc", corrupt_reads: int = 0, delay_s: float = 0.0) -> None:
        if mode not in ("enospc", "eio", "short"):
            raise ValueError(f"fault mode {mode!r}: choose enospc, eio or short")
        self.inner = inner
        self.name = inner.name
        self.delay_s = float(delay_s)
        self.fail_writes = fail_writes
        self.fail_reads = fail_reads
        self.corrupt_reads = corrupt_reads
        self.mode = mode
        self._lock = threading.Lock()

    def _take(self, name: str) -> bool:
        """Whether a fault of ``name`` is still owed, counting it off under a lock: writes
        are issued from several threads at once (the mover's, and the I/O thread that
        writes a batch's headers), and each owed fault must hit exactly one call."""
        with self._lock:
            left = getattr(self, name)
            if left > 0:
                setattr(self, name, left - 1)
            return left > 0

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
            f.set_exception(TierError("short write: a part of the bytes, then no more"))
        return f

    def pwrite(self, handle: Any, buffers: Sequence[Any], offset: int) -> "Future[int]":
        if self.delay_s:
            time.sleep(self.delay_s)
        if self._take("fail_writes"):
            if self.mode == "short":  # a real partial write (the first half of the first buffer), then the error
                return self._torn(handle, buffers[0], offset)
            return self._fail()
        return self.inner.pwrite(handle, buffers, offset)

    def _torn(self, handle: Any, first: Any, offset: int) -> "Future[int]":
        """The first half of ``first`` really written (its first page, where it has only
        one: O_DIRECT moves whole pages), then the short-write error; not waited for here:
        the header writes that follow a batch's payloads are issued from an I/O thread,
        which must not block on its own pool."""
        half = first.reshape(-1).view(np.uint8)[: max(ALIGN, first.nbytes // 2 // ALIGN * ALIGN)]
        out: "Future[int]" = Future()
        self.inner.pwrite(handle, [half], offset).add_done_callback(
            lambda _: out.set_exception(self._fail().exception() or RuntimeError("no fault")))
        return out

    def pread(self, handle: Any, buffers: Sequence[Any], offset: int) -> "Future[int]":
        if self.delay_s:
            time.sleep(self.delay_s)
        if self._take("fail_reads"):
            return self._fail()
        fut = self.inner.pread(handle, buffers, offset)
        if self._take("corrupt_reads"):
            fut.result()
            buf = buffers[-1]
            assert isinstance(buf, np.ndarray)
            buf.reshape(-1)[17] ^= 0xFF  # a flipped bit on the way back
        return fut

    def pread_many(self, handle: Any, reads: Sequence[tuple[Any, int]]) -> "Future[list[Any]]":
        return gather([self.pread(handle, [buf], off) for buf, off in reads])  # faults hit single reads

    def pread_checked(self, reads: Sequence[tuple[Any, Sequence[Any], int]],
                      check: Callable[[int], None],
                      sums: Any = None) -> "Future[list[Any]]":
        """Faults hit single reads; each check runs after the read and after any
        corruption injected into it (on the I/O thread, or here once it is done);
        ``sums`` is not used: ``check`` sees every injected corruption."""
        return gather([then_check(self.pread(h, bufs, off), partial(check, i))
                       for i, (h, bufs, off) in enumerate(reads)])

    def pwrite_many(self, writes: Sequence[tuple[Any, Sequence[Any], int]],
                    then: Optional[Then] = None) -> "Future[list[Any]]":
        first = gather([self.pwrite(h, bufs, off) for h, bufs, off in writes])  # faults hit single writes
        return first if then is None else followed(first, then, self.pwrite_many)

    def fsync(self, handle: Any) -> None:
        self.inner.fsync(handle)

    def close(self, handle: Any) -> None:
        self.inner.close(handle)

    def shutdown(self) -> None:
        self.inner.shutdown()


def faulty_from_env(inner: Any) -> FaultyBackend:
    """``io_backend = "faulty"``: ``inner`` wrapped with the faults named in ``KVTIER_FAULTS``."""
    kw: dict[str, Any] = {}
    spec = os.environ.get("KVTIER_FAULTS", "")
    for item in filter(None, (x.strip() for x in spec.split(","))):
        key, _, value = item.partition("=")
        if key not in ("fail_writes", "fail_reads", "corrupt_reads", "delay_s", "mode"):
            raise ValueError(f"KVTIER_FAULTS: unknown fault {key!r}")
        kw[key] = value if key == "mode" else float(value) if key == "delay_s" else int(value)
    return FaultyBackend(inner, **kw)
