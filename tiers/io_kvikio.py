"""The kvikio NVMe backend: NVIDIA kvikio ``CuFile`` (GPUDirect Storage, or kvikio's
compat mode), reading and writing host or device buffers. Needs ``libcuda.so.1``; the
posix backend (``io_backends``) serves everywhere else. Both pass the same conformance
suite (tests/tiers/test_io_conformance.py and test_io_recovery.py)."""

from __future__ import annotations

import ctypes
import os
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, Callable, Optional, Sequence

import numpy as np

from .futures import Failures, Then, Write, followed, gather, then_check
from .types import TierError

Buffer = Any  # numpy uint8 array (host) or torch CUDA tensor


def _nbytes(buf: Buffer) -> int:
    if isinstance(buf, np.ndarray):
        return int(buf.nbytes)
    return int(buf.numel() * buf.element_size())


def cuda_driver_present() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def kvikio_status() -> tuple[bool, str]:
    """(usable, reason) for the kvikio backend on this machine."""
    try:
        import kvikio  # noqa: F401
    except Exception as e:  # ImportError, or a broken CUDA runtime import
        return False, (f"kvikio is not installed ({e.__class__.__name__}: {e}); "
                       "pip install 'kvtier[gpu]' (CUDA 12) or 'kvtier[gpu-cu13]' (CUDA 13)")
    if not cuda_driver_present():
        return False, "kvikio needs libcuda.so.1 (no CUDA driver on this machine)"
    return True, "ok"


class KvikioHandle:
    __slots__ = ("file", "path")

    def __init__(self, file: Any, path: str) -> None:
        self.file = file
        self.path = path


def _all_bytes(parts: list[Any]) -> int:
    """The bytes of every part, each waited for even after one failed (then the first
    failure is raised): a failed block's slot is released on the failure, and a part
    still in flight would land in it after it went to another block."""
    total, first = 0, None
    for p in parts:
        try:
            total += int(p.get())
        except Exception as e:  # kvikio raises its own RuntimeErrors
            first = first or e
    if first is not None:
        raise first
    return total


class _Joined(Future):
    """One future over several kvikio IOFutures (header + payload), done when all are;
    fewer bytes than asked (end of file) is an error, as in the posix backend."""

    def __init__(self, parts: list[Any], pool: ThreadPoolExecutor, expected: int) -> None:
        super().__init__()
        self._expected = expected
        self._inner = pool.submit(_all_bytes, parts)
        self._inner.add_done_callback(self._copy)

    def _copy(self, f: "Future[int]") -> None:
        exc = f.exception()
        if exc is not None:
            self.set_exception(TierError(f"kvikio I/O failed: {exc}"))
        elif f.result() < self._expected:
            self.set_exception(TierError(f"short kvikio I/O: {f.result()} of {self._expected} bytes"))
        else:
            self.set_result(f.result())


class KvikioBackend:
    """kvikio CuFile backend (GDS where available, compat mode otherwise)."""

    name = "kvikio"

    def __init__(self, threads: int = 8) -> None:
        ok, why = kvikio_status()
        if not ok:
            raise RuntimeError(why)
        import kvikio
        import kvikio.defaults

        self._kvikio = kvikio
        try:
            kvikio.defaults.set({"num_threads": int(threads)})
        except Exception:
            pass
        self._waiters = ThreadPoolExecutor(max(1, threads), thread_name_prefix="kvtier-kvikio")

    def open(self, path: str, size: int) -> KvikioHandle:
        if not os.path.exists(path):
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)
            finally:
                os.close(fd)
        elif os.path.getsize(path) < size:
            with open(path, "r+b") as f:
                os.posix_fallocate(f.fileno(), 0, size)
        return KvikioHandle(self._kvikio.CuFile(path, "r+"), path)

    def _submit(self, method: str, handle: KvikioHandle, buffers: Sequence[Buffer], offset: int) -> "Future[int]":
        parts = []
        off = offset
        for b in buffers:
            n = _nbytes(b)
            parts.append(getattr(handle.file, method)(b, n, off))
            off += n
        return _Joined(parts, self._waiters, off - offset)

    def pwrite(self, handle: KvikioHandle, buffers: Sequence[Buffer], offset: int) -> "Future[int]":
        return self._submit("pwrite", handle, buffers, offset)

    def pread(self, handle: KvikioHandle, buffers: Sequence[Buffer], offset: int) -> "Future[int]":
        return self._submit("pread", handle, buffers, offset)

    def pread_many(self, handle: KvikioHandle, reads: Sequence[tuple[Buffer, int]]) -> "Future[Failures]":
        return gather([self.pread(handle, [buf], off) for buf, off in reads])  # kvikio splits and queues them

    def pwrite_many(self, writes: Sequence[Write], then: Optional[Then] = None) -> "Future[Failures]":
        first = gather([self.pwrite(h, bufs, off) for h, bufs, off in writes])  # kvikio queues each
        return first if then is None else followed(first, then, self.pwrite_many)

    def pread_checked(self, reads: Sequence[tuple[KvikioHandle, Sequence[Buffer], int]],
                      check: Callable[[int], None],
                      sums: Optional[Any] = None) -> "Future[Failures]":
        """Each read queued on kvikio; ``check(i)`` runs on the waiter thread that saw
        read i complete (a device buffer is checked on the device; ``sums`` is not used)."""
        return gather([then_check(self.pread(h, bufs, off), partial(check, i))
                       for i, (h, bufs, off) in enumerate(reads)])

    def fsync(self, handle: KvikioHandle) -> None:
        os.fsync(handle.file.fileno())

    def close(self, handle: KvikioHandle) -> None:
        handle.file.close()

    def shutdown(self) -> None:
        self._waiters.shutdown(wait=True)


__all__ = ["KvikioBackend", "cuda_driver_present", "kvikio_status"]
