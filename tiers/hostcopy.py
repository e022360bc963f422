"""Host-memory copies for CPU pools: chunks pulled by whichever thread is free.

torch's ``copy_`` splits a large copy statically over its OpenMP threads, whose
workers then spin-wait after it: measured here, ~1 ms of a core per call, and
~20% more CPU than one ``memcpy`` for a 256 MiB copy on a host whose memory
bandwidth one core already fills. On a busy host a static split also ends
when its slowest share does. Here the calling thread copies chunk after chunk
itself, and up to ``threads - 1`` helpers, blocked on a queue (not spinning),
pull chunks too while any are left: a helper that gets no core in time finds
nothing to do, so the copy is never much slower than one thread's, and it
spreads over idle cores where there are some.

Where the compiled kernel was built (``kernels/_copy.c``), every thread pulls
pairs in C with the GIL released for the whole job: no thread waits for the
interpreter between chunks while the owner plans the next move, and large
pairs use streaming stores (1.5x glibc's memcpy on the host measured). Without
it, each chunk is an ``np.copyto`` (which releases the GIL for the copy only).
"""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

import numpy as np

try:
    from kvtier.kernels._copy import copy_pairs as _c_copy_pairs
except ImportError:  # pragma: no cover - exercised where the extension was not built
    _c_copy_pairs = None

CHUNK_BYTES = 4 << 20  # a chunk's copy (~0.5 ms) dwarfs the ~3 µs of Python that hands it out

Pair = tuple[np.ndarray, np.ndarray]  # (dst, src), same shape


def chunks(pairs: Sequence[Pair], chunk_bytes: Optional[int] = None) -> list[list[Pair]]:
    """The pairs cut into row ranges and grouped so that each chunk moves about
    ``chunk_bytes`` (default: ``CHUNK_BYTES`` at call time): a large run is split, small
    scattered runs share a chunk."""
    chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    out: list[list[Pair]] = []
    cur: list[Pair] = []
    size = 0
    for dst, src in pairs:
        row = max(1, dst[:1].nbytes)
        step = max(1, chunk_bytes // row)
        for lo in range(0, dst.shape[0], step):
            d, s = dst[lo: lo + step], src[lo: lo + step]
            cur.append((d, s))
            size += d.nbytes
            if size >= chunk_bytes:
                out.append(cur)
                cur, size = [], 0
    if cur:
        out.append(cur)
    return out


class _Job:
    """One copy's parts, shared by the caller and its helpers: ``work`` copies until
    none is left, ``wait`` returns once every part is copied (or raises its error)."""

    def __init__(self, left: int) -> None:
        self._left = left
        self._lock = threading.Lock()
        self._done = threading.Event()
        self.error: Optional[BaseException] = None

    def work(self) -> None:
        raise NotImplementedError

    def _finished(self, n: int) -> None:
        with self._lock:
            self._left -= n
            if self._left <= 0:
                self._done.set()

    def wait(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise self.error


class _NumpyJob(_Job):
    """Chunks taken one at a time, each pair an ``np.copyto`` (the GIL is held between copies)."""

    def __init__(self, parts: list[list[Pair]]) -> None:
        super().__init__(len(parts))
        self.parts = parts
        self._next = itertools.count()  # next() is atomic under the GIL: each chunk is taken once

    def work(self) -> None:
        while True:
            i = next(self._next)
            if i >= len(self.parts):
                return
            try:
                for dst, src in self.parts[i]:
                    np.copyto(dst, src)  # releases the GIL for the copy
            except BaseException as e:  # reported by wait(), on the caller's thread
                self.error = e
            self._finished(1)


class _CompiledJob(_Job):
    """Pairs pulled in C from a shared counter, the GIL released for the whole loop."""

    def __init__(self, parts: list[list[Pair]]) -> None:
        self._dsts = [d for part in parts for d, _ in part]
        self._srcs = [s for part in parts for _, s in part]
        super().__init__(len(self._dsts))
        self._counter = np.zeros(1, dtype=np.int64)

    def work(self) -> None:
        try:
            self._finished(_c_copy_pairs(self._dsts, self._srcs, self._counter))
        except BaseException as e:  # a bad pair fails every thread before any byte moves
            self.error = e
            self._done.set()


class HostCopier:
    """Copies between host arrays over the calling thread and ``threads - 1`` helpers."""

    def __init__(self, threads: int, compiled: Optional[bool] = None) -> None:
        self.threads = max(1, int(threads))
        # the compiled pull loop where it was built (``compiled=False``: numpy's copies)
        self.compiled = _c_copy_pairs is not None if compiled is None else compiled and _c_copy_pairs is not None
        self._pool = (ThreadPoolExecutor(self.threads - 1, thread_name_prefix="kvtier-copy")
                      if self.threads > 1 else None)

    def copy(self, pairs: Sequence[Pair]) -> None:
        """Copy every (dst, src) pair; done on return (an error is raised here)."""
        parts = chunks(pairs)
        if not parts:
            return
        for d, s in pairs:  # every pair before any byte moves (the kernel compares bytes only)
            if d.shape != s.shape:
                raise ValueError(f"copy: a pair of shapes {d.shape} and {s.shape}")
        compiled = self.compiled and all(d.flags.c_contiguous and s.flags.c_contiguous and d.dtype == s.dtype
                                         for d, s in pairs)  # else numpy: strides, casts
        # strided pairs (a layer's columns of each slot): numpy's copies
        job: _Job = _CompiledJob(parts) if compiled else _NumpyJob(parts)
        if self._pool is not None and len(parts) > 1:
            for _ in range(min(self.threads - 1, len(parts) - 1)):
                self._pool.submit(job.work)
        job.work()
        job.wait()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


__all__ = ["CHUNK_BYTES", "HostCopier", "chunks"]
