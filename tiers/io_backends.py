"""NVMe I/O backends behind one small interface.

* ``posix``: a thread pool issuing ``os.pwritev``/``os.preadv`` on a file
  opened with O_DIRECT (the pool gives queue depth; the calls drop the GIL).
  Where the filesystem refuses O_DIRECT, at open (tmpfs on older kernels,
  some overlay mounts) or at the first transfer (some FUSE and network
  filesystems), it falls back to buffered I/O, logs a warning once per file
  and says so in ``direct``. Each pool thread moves its share of a batch in one
  call of a compiled loop without the GIL (``kernels/_blockio.c``) where it was built.
* ``kvikio``: NVIDIA kvikio ``CuFile`` (GPUDirect Storage, or kvikio's compat
  mode); reads and writes host or device buffers. Needs ``libcuda.so.1``
  (``io_kvikio``).

Backends are looked up by name in ``BACKENDS``; ``select_backend("auto")``
takes kvikio where a CUDA driver exists and posix elsewhere. Every backend
passes the same conformance suite (tests/tiers/test_io_conformance.py, test_io_recovery.py).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional, Protocol, Sequence

import numpy as np

from .futures import Failures, Then, Write
from .io_kvikio import KvikioBackend, kvikio_status
from .types import TierError

try:  # a share of block I/O in one call without the GIL (kernels/_blockio.c)
    import kvtier.kernels._blockio as _blockio
except ImportError:  # pragma: no cover - where the extension was not built: one Python call a block
    _blockio = None

Buffer = Any  # numpy uint8 array (host) or torch CUDA tensor (kvikio only)
Sums = Sequence[Optional[tuple[int, int]]]  # per read: (length, block checksum) its first buffer must have, or None
log = logging.getLogger("kvtier.io")


class IOBackend(Protocol):
    name: str

    def open(self, path: str, size: int) -> Any: ...
    def pwrite(self, handle: Any, buffers: Sequence[Buffer], offset: int) -> "Future[int]": ...
    def pread(self, handle: Any, buffers: Sequence[Buffer], offset: int) -> "Future[int]": ...
    def pread_many(self, handle: Any, reads: Sequence[tuple[Buffer, int]]) -> "Future[Failures]": ...
    def pwrite_many(self, writes: Sequence[tuple[Any, Sequence[Buffer], int]],
                    then: Optional[Then] = None) -> "Future[Failures]": ...
    def pread_checked(self, reads: Sequence[tuple[Any, Sequence[Buffer], int]],
                      check: Callable[[int], None], sums: Optional[Sums] = None) -> "Future[Failures]": ...
    def fsync(self, handle: Any) -> None: ...
    def close(self, handle: Any) -> None: ...
    def shutdown(self) -> None: ...


class PosixHandle:
    """An open slab file. ``fd`` and ``direct`` are read as one tuple, so a thread
    never pairs a new descriptor with a stale flag while another falls back."""

    __slots__ = ("path", "_io", "_retired", "_lock")

    def __init__(self, fd: int, path: str, direct: bool) -> None:
        self.path = path
        self._io = (fd, direct)
        self._retired: list[int] = []  # refused O_DIRECT descriptors: closed with the handle
        self._lock = threading.Lock()

    @property
    def fd(self) -> int:
        return self._io[0]

    @property
    def direct(self) -> bool:
        return self._io[1]

    def fall_back(self, refused_fd: int) -> int:
        """The filesystem refused an O_DIRECT transfer on ``refused_fd``: reopen the
        file buffered (once, whichever thread gets here first) and return the fd
        to retry on. The old fd stays open, as other threads may be using it."""
        with self._lock:
            fd, direct = self._io
            if direct and fd == refused_fd:
                self._retired.append(fd)
                fd = os.open(self.path, os.O_RDWR)
                self._io = (fd, False)
                log.warning("%s: the filesystem refused an O_DIRECT transfer; using buffered I/O "
                            "(the page cache now holds NVMe-tier data)", self.path)
            return fd

    def close(self) -> None:
        with self._lock:
            for fd in (self._io[0], *self._retired):
                os.close(fd)
            self._retired.clear()


class PosixBackend:
    """Thread-pool O_DIRECT backend."""

    name = "posix"

    def __init__(self, threads: int = 8, use_direct: bool = True, compiled: bool = True) -> None:
        self.threads = max(1, int(threads))
        self.use_direct = use_direct
        self.compiled = compiled and _blockio is not None  # False: every block through ``_loop`` (tests compare)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kvtier-io")

    def open(self, path: str, size: int) -> PosixHandle:
        flags = os.O_RDWR | os.O_CREAT
        direct = self.use_direct and hasattr(os, "O_DIRECT")
        try:
            fd = os.open(path, flags | (os.O_DIRECT if direct else 0), 0o600)
        except OSError as e:
            if not direct or e.errno != errno.EINVAL:
                raise
            fd = os.open(path, flags, 0o600)
            direct = False
            log.warning("%s: the filesystem refuses O_DIRECT; using buffered I/O "
                        "(the page cache will hold NVMe-tier data)", path)
        try:
            if os.fstat(fd).st_size < size:
                os.posix_fallocate(fd, 0, size)
        except OSError:
            os.close(fd)
            raise
        return PosixHandle(fd, path, direct)

    @staticmethod
    def _views(buffers: Sequence[Buffer], into: bool = False) -> list[memoryview]:
        """Byte views for the vectored calls. ``memoryview(b)``, not ``b.data``: numpy
        exports ``.data`` as a writable buffer, which walks the array's bases and probes
        the shared-memory mmap under a pool slot, ~5x the cost (2-10 µs a block
        under load), paid twice per block written and once per block read."""
        out = []
        for b in buffers:
            if not isinstance(b, np.ndarray):
                raise TypeError("the posix backend takes host numpy buffers")
            if into and not b.flags.c_contiguous:  # reshape copies it: the read landed in the copy, reported done
                raise ValueError("the posix backend reads into contiguous buffers only")
            if b.ndim != 1 or b.dtype != np.uint8:
                b = b.reshape(-1).view(np.uint8)
            out.append(memoryview(b))
        return out

    @staticmethod
    def _loop(op: Callable[[int, list[memoryview], int], int], handle: PosixHandle,
              views: list[memoryview], offset: int, what: str) -> int:
        """Repeat a vectored call until every byte moved (short I/O resumes). EINVAL
        on an O_DIRECT descriptor means the filesystem refuses direct transfers:
        fall back to buffered I/O and retry; on a buffered one it is an error."""
        fd, direct = handle._io
        total = sum(v.nbytes for v in views)
        done = 0
        while done < total:
            try:
                n = op(fd, views, offset + done)
            except OSError as e:
                if e.errno != errno.EINVAL or not direct:
                    raise
                fd, direct = handle.fall_back(fd), False
                continue
            if n <= 0:
                raise TierError(f"short {what}: {done} of {total} bytes at offset {offset}")
            done += n
            # drop fully transferred views, trim the partial one
            while views and n >= views[0].nbytes:
                n -= views[0].nbytes
                views = views[1:]
            if n:
                views = [views[0][n:], *views[1:]]
        return total

    def pwrite(self, handle: PosixHandle, buffers: Sequence[Buffer], offset: int) -> "Future[int]":
        views = self._views(buffers)
        return self._pool.submit(self._loop, os.pwritev, handle, views, offset, "write")

    def pread(self, handle: PosixHandle, buffers: Sequence[Buffer], offset: int) -> "Future[int]":
        views = self._views(buffers, into=True)
        return self._pool.submit(self._loop, os.preadv, handle, views, offset, "read")

    def pread_many(self, handle: PosixHandle, reads: Sequence[tuple[Buffer, int]]) -> "Future[Failures]":
        """Many small reads (a restart's slot headers) as one pool task: a future per
        4 KiB read costs as much Python as the read itself. Each read fails alone."""
        return self._each(os.preadv, [(handle, [buf], off) for buf, off in reads], "read")

    def pwrite_many(self, writes: Sequence[Write], then: Optional[Then] = None) -> "Future[Failures]":
        """Many block writes (handle, buffers, offset) as one pool task, one after the other,
        each failing alone. The mover gives each pool thread one such share of a batch: a
        future and a hand-off per block cost as much Python as a 256 KiB write, and on a
        small host that Python competes with the I/O threads for the cores. ``then``'s
        writes run in the same task after these (not queued behind other tasks); the
        result lists the failures of both, these first."""
        return self._each(os.pwritev, writes, "write", then=then)

    def pread_checked(self, reads: Sequence[tuple[PosixHandle, Sequence[Buffer], int]],
                      check: Callable[[int], None], sums: Optional[Sums] = None) -> "Future[Failures]":
        """Reads (handle, buffers, offset) as one pool task, like ``pwrite_many``, each
        verified on the same I/O thread: verification overlaps the other threads' reads
        instead of waiting for the caller's thread. ``sums[i]`` (length, checksum) is
        checked in the compiled loop where it exists; ``check(i)`` runs otherwise, and
        on a mismatch, to raise the caller's own error. A read that fails, or whose
        check fails, fails alone."""
        return self._each(os.preadv, reads, "read", check, sums)

    def _each(self, op: Callable[..., int], jobs: Sequence[Write], kind: str,
              check: Optional[Callable[[int], None]] = None,
              sums: Optional[Sums] = None, then: Optional[Then] = None) -> "Future[Failures]":
        """Jobs (handle, buffers, offset) as one pool task, one after the other, each failing
        alone; ``check(i)``, if given, runs after job i moved its bytes (unless the
        compiled loop verified ``sums[i]`` already); ``then``'s writes after them.

        The jobs' byte views are made on the pool thread that runs them, and ``jobs`` is
        iterated only there (only its ``len`` here; it may be a lazy sequence,
        ``nvme_batch``'s rows): a batch's
        Python then runs a share at a time beside the other threads' I/O. Made by the
        caller, a 256-block batch held the GIL 1.5-2 ms before its first write could
        start. A buffer the backend cannot take fails its share's future (the whole share, as
        the whole call raised before), not the caller."""
        if sums is not None and len(sums) != len(jobs):
            raise ValueError(f"{len(sums)} checksums for {len(jobs)} reads")

        def share() -> Failures:
            out = self._run(op, self._prepared(jobs, into=kind == "read"), kind, check, sums)
            if then is None:
                return out
            return out + self._run(op, self._prepared(then(out)), kind, None, None)

        return self._pool.submit(share)

    @classmethod
    def _prepared(cls, jobs: Sequence[Write], into: bool = False) -> list[tuple[PosixHandle, list[memoryview], int]]:
        return [(h, cls._views(bufs, into), off) for h, bufs, off in jobs]

    def _run(self, op: Callable[..., int], jobs: list[tuple[PosixHandle, list[memoryview], int]],
             kind: str, check: Optional[Callable[[int], None]], sums: Optional[Sums]) -> Failures:
        if self.compiled and all(len(v) <= _blockio.MAX_IOV for _, v, _ in jobs):
            return self._run_compiled(op, jobs, kind, check, sums)
        return self._run_python(op, jobs, kind, check)

    def _run_python(self, op: Callable[..., int], jobs: list[tuple[PosixHandle, list[memoryview], int]],
                    kind: str, check: Optional[Callable[[int], None]]) -> Failures:
        out: Failures = []
        for i, (h, views, off) in enumerate(jobs):
            try:
                self._loop(op, h, views, off, kind)
                if check is not None:
                    check(i)
                out.append(None)
            except Exception as e:  # OSError, TierError, or the check's: this job's failure
                out.append(e)
        return out

    def _run_compiled(self, op: Callable[..., int], jobs: list[tuple[PosixHandle, list[memoryview], int]],
                      kind: str, check: Optional[Callable[[int], None]], sums: Optional[Sums]) -> Failures:
        """The share in one C call without the GIL (the GIL taken back per block kept the
        disk short of requests behind the mover's planning). A block the loop could not
        move goes through ``_loop`` only where it owns the outcome: the "short" message
        at end of file, and the fall-back from an O_DIRECT descriptor's EINVAL; any other
        I/O error is raised as the call would raise it. Arguments the loop refuses (a
        read-only buffer, an offset out of range) send the share down the Python path,
        where each job fails alone, as before."""
        ios = [h._io for h, _, _ in jobs]  # (fd, direct) as the loop uses them
        try:
            status = _blockio.transfer(kind == "write", [fd for fd, _ in ios], [off for _, _, off in jobs],
                                       [views for _, views, _ in jobs], None if check is None else sums)
        except (BufferError, TypeError, ValueError, OverflowError):
            return self._run_python(op, jobs, kind, check)
        out: Failures = []
        for i, (st, (h, views, off)) in enumerate(zip(status, jobs)):
            try:
                if st > 0 and not (st == errno.EINVAL and ios[i][1]):
                    raise OSError(st, os.strerror(st))
                if st > 0 or st == _blockio.SHORT:
                    self._loop(op, h, views, off, kind)
                if check is not None and (st != 0 or sums is None or sums[i] is None):
                    check(i)  # not verified in C, or failed there: the caller's check names the failure
                out.append(None)
            except Exception as e:  # OSError, TierError, or the check's: this job's failure
                out.append(e)
        return out

    def fsync(self, handle: PosixHandle) -> None:
        os.fsync(handle.fd)

    def close(self, handle: PosixHandle) -> None:
        handle.close()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


def _faulty(threads: int = 8) -> IOBackend:
    from .faults import faulty_from_env  # fault injection: loaded only when asked for

    return faulty_from_env(PosixBackend(threads=threads))


BACKENDS: dict[str, Callable[..., IOBackend]] = {
    "posix": PosixBackend,
    "kvikio": KvikioBackend,
    "faulty": _faulty,  # fault injection (KVTIER_FAULTS); never picked by "auto"
}


def select_backend(name: str = "auto", threads: int = 8) -> IOBackend:
    """Build a backend by name; ``auto`` prefers kvikio where it can run."""
    if name == "auto":
        name = "kvikio" if kvikio_status()[0] else "posix"
    elif name == "kvikio" and not kvikio_status()[0]:  # a setting that cannot run here: bad input, not a bug
        raise ValueError(f"I/O backend 'kvikio' cannot run here: {kvikio_status()[1]}")
    try:
        factory = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown I/O backend {name!r}; choose from {['auto', *BACKENDS]}") from None
    return factory(threads=threads)
