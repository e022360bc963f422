"""Host-memory copies for CPU pools: pieces pulled by whichever thread is free.

torch's ``copy_`` splits a large copy statically over its OpenMP threads, whose
workers then spin-wait after it: measured here, ~1 ms of a core per call, and
~20% more CPU than one ``memcpy`` for a 256 MiB copy on a host whose memory
bandwidth one core already fills. On a busy host a static split also ends
when its slowest share does. Here the calling thread copies piece after piece
itself, and up to ``threads - 1`` helpers, blocked (not spinning), pull pieces
too while any are left: a helper that gets no core in time finds nothing to do,
so the copy is never much slower than one thread's, and it spreads over idle
cores where there are some.

Where the compiled kernel was built (``kernels/_copy.c``), the pieces are pulled
in C with the GIL released for the whole copy, by helper threads that never take
it (a Python helper could not start while the daemon's owner thread ran Python),
and large pieces use streaming stores. Rows go as two int64 arrays of row numbers,
which the kernel turns into runs of bytes, so a scattered move costs no Python
object per block. Without the kernel,
each chunk is an ``np.copyto`` (which releases the GIL for the copy only).
"""

from __future__ import annotations

import itertools
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

import numpy as np

try:
    from kvtier.kernels._copy import CopyJob
    from kvtier.kernels._copy import copy_pairs as _c_copy_pairs
    from kvtier.kernels._copy import copy_rows as _c_copy_rows
    from kvtier.kernels._copy import start_rows as _c_start_rows
except ImportError:  # pragma: no cover - exercised where the extension was not built
    _c_copy_pairs = _c_copy_rows = _c_start_rows = CopyJob = None

CHUNK_BYTES = 4 << 20  # a chunk's copy (~0.5 ms) dwarfs the ~3 µs of Python that hands it out
# rows' runs are pulled in pieces of at most this many bytes (in C, no Python per piece): a
# pass ends when its last piece does, so a smaller piece leaves less of one core idle at the end
PIECE_BYTES = 1 << 20

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


class _NumpyJob:
    """One copy's chunks, shared by the caller and its helpers: ``work`` takes chunks one at a
    time, each pair an ``np.copyto`` (the GIL is held between copies), until none is left;
    ``wait`` returns once every chunk is copied (or raises the error one raised)."""

    def __init__(self, parts: list[list[Pair]]) -> None:
        self.parts = parts
        self._next = itertools.count()  # next() is atomic under the GIL: each chunk is taken once
        self._left = len(parts)
        self._lock = threading.Lock()
        self._done = threading.Event()
        self.error: Optional[BaseException] = None

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
            with self._lock:
                self._left -= 1
                if self._left <= 0:
                    self._done.set()

    def wait(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise self.error


def row_runs(dst_idx: np.ndarray, src_idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dst starts, src starts, lengths) of the runs of rows consecutive on both sides."""
    dst_idx, src_idx = np.asarray(dst_idx, dtype=np.int64), np.asarray(src_idx, dtype=np.int64)
    if dst_idx.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    brk = np.flatnonzero((np.diff(dst_idx) != 1) | (np.diff(src_idx) != 1)) + 1
    starts = np.concatenate(([0], brk))
    ends = np.concatenate((brk, [dst_idx.size]))
    return dst_idx[starts], src_idx[starts], ends - starts


class HostCopier:
    """Copies between host arrays over the calling thread and ``threads - 1`` helpers."""

    def __init__(self, threads: int, compiled: Optional[bool] = None) -> None:
        self.threads = max(1, int(threads))
        # the compiled pull loop where it was built (``compiled=False``: numpy's copies)
        self.compiled = _c_copy_pairs is not None if compiled is None else compiled and _c_copy_pairs is not None
        # Python helpers for numpy's copies only: the compiled kernel has its own, outside the interpreter
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
        if self.compiled and all(d.flags.c_contiguous and s.flags.c_contiguous and d.dtype == s.dtype
                                 for d, s in pairs):  # else numpy: strides, casts
            _c_copy_pairs([d for part in parts for d, _ in part], [s for part in parts for _, s in part],
                          self.threads)
            return
        # strided pairs (a layer's columns of each slot): numpy's copies
        job = _NumpyJob(parts)
        if self._pool is not None and len(parts) > 1:
            for _ in range(min(self.threads - 1, len(parts) - 1)):
                self._pool.submit(job.work)
        job.work()
        job.wait()

    def _row_bytes(self, dst: np.ndarray, src: np.ndarray) -> int:
        """Bytes a row where the compiled loop takes the two arrays' rows whole (C-contiguous,
        rows of one shape and type), else 0: a layer's columns of each row are strided."""
        if not (self.compiled and dst.ndim >= 1 and dst.shape[1:] == src.shape[1:] and dst.dtype == src.dtype
                and dst.flags.c_contiguous and src.flags.c_contiguous):
            return 0
        return dst.itemsize * math.prod(dst.shape[1:])

    @staticmethod
    def _row_views(dst: np.ndarray, dst_idx: np.ndarray, src: np.ndarray, src_idx: np.ndarray) -> list[Pair]:
        """The rows' runs as (dst, src) views for ``copy`` (numpy's copies), every row checked first."""
        d0, s0, k = row_runs(dst_idx, src_idx)
        if ((d0 < 0) | (s0 < 0) | (d0 + k > len(dst)) | (s0 + k > len(src))).any():
            raise IndexError(f"copy_rows: rows outside {len(dst)} destination / {len(src)} source rows")
        return [(dst[a: a + n], src[b: b + n]) for a, b, n in zip(d0.tolist(), s0.tolist(), k.tolist())]

    @staticmethod
    def _rows(dst_idx: np.ndarray, src_idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if len(dst_idx) != len(src_idx):
            raise ValueError(f"copy_rows: {len(dst_idx)} destination and {len(src_idx)} source rows")
        return np.ascontiguousarray(dst_idx, dtype=np.int64), np.ascontiguousarray(src_idx, dtype=np.int64)

    def copy_rows(self, dst: np.ndarray, dst_idx: np.ndarray, src: np.ndarray, src_idx: np.ndarray) -> None:
        """Copy rows ``src[src_idx]`` to ``dst[dst_idx]`` (done on return). Rows consecutive on
        both sides go as one run; whole rows go to the compiled loop as two int64 arrays of row
        numbers however scattered (it finds the runs and checks every row), with no Python object
        a block. Rows of one array (overlapping) are copied run by run in order, as memmove would."""
        dst_idx, src_idx = self._rows(dst_idx, src_idx)
        row = self._row_bytes(dst, src)
        if row:
            _c_copy_rows(dst, src, dst_idx, src_idx, row, PIECE_BYTES, self.threads)
        else:
            self.copy(self._row_views(dst, dst_idx, src, src_idx))

    def start_rows(self, dst: np.ndarray, dst_idx: np.ndarray, src: np.ndarray,
                   src_idx: np.ndarray) -> Optional["CopyJob"]:
        """``copy_rows`` begun on the kernel's helper threads before this returns (its ``join()``
        finishes it, on any thread), or None where the rows need numpy's copies. A copy started
        so needs no Python thread to get going: the owner thread starts it as it plans the next."""
        dst_idx, src_idx = self._rows(dst_idx, src_idx)
        row = self._row_bytes(dst, src)
        if not row or np.may_share_memory(dst, src):  # rows of one array: copied in order, by ``copy_rows``
            return None
        return _c_start_rows(dst, src, dst_idx, src_idx, row, PIECE_BYTES, self.threads)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


__all__ = ["CHUNK_BYTES", "PIECE_BYTES", "HostCopier", "chunks", "row_runs"]
