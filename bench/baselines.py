"""Raw baselines of ``bench tiers``: the fastest ways this machine moves the same bytes.

A ratio against a slow baseline says nothing (an 8-thread mover "beat the disk"
against one thread at queue depth 1). So every data path is measured several
ways and the headline ratio divides by the best of them:

- memory copies between two POSIX shared-memory buffers (the memory both pools
  are made of): one ``np.copyto`` (one core), torch's ``copy_`` (its intra-op
  threads, as many as the mover gets: it copies with torch in this process),
  a pool of as many threads as torch has, each ``np.copyto``-ing its share, and
  the mover's own way (``HostCopier.copy_rows``: 1 MiB pieces pulled in C by the
  calling thread and idle helpers), so the mover never beats a baseline by a
  method the baselines lack;
- O_DIRECT I/O on the DRAM tier's own slot memory: one ``pwrite``/``preadv``
  per block, sequentially (queue depth 1), and from as many threads as the
  posix backend's pool (``tiers.io_threads``), each looping over its share
  of the blocks, so that many are in flight at once, as the backend keeps them;
  and the same threads each moving its share in one call of the backend's own
  compiled loop (no GIL between blocks), so kvtier's loop is no method the
  baselines lack.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor, wait
from multiprocessing import shared_memory
from typing import Callable, Optional

import numpy as np
import torch

from kvtier.tiers.aligned import aligned_empty
from kvtier.tiers.hostcopy import HostCopier
from kvtier.tiers.io_backends import _blockio

COPY_BASELINES = ("memcpy_tier", "torch_copy_tier", "threads_copy_tier", "chunks_copy_tier")
# the *_qd_c loops: the same threads and blocks, each thread's share in one call of the
# compiled loop the posix backend uses (kernels/_blockio.c), with no checksum or header
COMPILED_IO = _blockio is not None
WRITE_BASELINES = ("raw_odirect_write_tier", "raw_odirect_write_tier_qd",
                   *(("raw_odirect_write_tier_qd_c",) if COMPILED_IO else ()))
READ_BASELINES = ("raw_odirect_read_tier", "raw_odirect_read_tier_qd",
                  *(("raw_odirect_read_tier_qd_c",) if COMPILED_IO else ()))


def _shares(n: int, k: int) -> list[tuple[int, int]]:
    """``k`` contiguous ranges covering ``range(n)``, sizes within one of each other."""
    bounds = [n * i // k for i in range(k + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(k) if bounds[i + 1] > bounds[i]]


def _join(futures: list[Future]) -> None:
    """Wait for every share, then raise the first failure: raising at the first one left the
    others reading into the buffer while the caller went on (a test saw a block it had just
    rewritten overwritten with the disk's old bytes, and written back)."""
    wait(futures)
    for f in futures:
        f.result()


class RawODirect:
    """The baseline disk path on one O_DIRECT file, one I/O per block.

    ``buf`` is the memory the I/O goes to and from. The ratios use the DRAM tier's
    own slot memory (read into only while no block holds a DRAM copy): how fast the
    kernel moves O_DIRECT data to and from a buffer varies by ~2x on this kind of VM
    with the buffer's history, so a baseline on other memory measures the memory,
    not kvtier. One buffer per block, like the tier's slots: a single cache-hot
    buffer would flatter the baseline. ``threads`` > 1 gives the ``*_qd`` figures."""

    def __init__(self, directory: str, name: str, block: int, n: int, buf: Optional[np.ndarray] = None,
                 threads: int = 8) -> None:
        self.path = os.path.join(directory, f"raw-odirect-{name}.bin")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o600)
        os.posix_fallocate(self.fd, 0, block * n)
        if buf is None:
            buf = aligned_empty(block * n)
            buf[:] = 7
        self.buf = buf
        self.block, self.n = block, n
        self.threads = max(1, threads)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="raw-odirect")

    def _loop(self, op: Callable, lo: int, hi: int) -> None:
        b, fd, buf = self.block, self.fd, self.buf.data  # one memoryview, sliced per block: no numpy per block
        for i in range(lo, hi):
            op(fd, [buf[i * b:(i + 1) * b]], i * b)

    def write(self) -> None:
        self._loop(os.pwritev, 0, self.n)

    def read(self) -> None:
        self._loop(os.preadv, 0, self.n)

    def _compiled(self, write: bool, lo: int, hi: int, sums: Optional[list[tuple[int, int]]] = None) -> None:
        b, fd, buf = self.block, self.fd, self.buf.data
        status = _blockio.transfer(write, [fd] * (hi - lo), [i * b for i in range(lo, hi)],
                                   [[buf[i * b:(i + 1) * b]] for i in range(lo, hi)],
                                   None if sums is None else sums[lo:hi])
        if any(status):
            raise OSError(f"raw O_DIRECT {'write' if write else 'read'} failed: {sorted(set(status))}")

    def _parallel(self, op: Callable) -> None:
        _join([self._pool.submit(self._loop, op, lo, hi) for lo, hi in _shares(self.n, self.threads)])

    def _parallel_compiled(self, write: bool, sums: Optional[list[tuple[int, int]]] = None) -> None:
        _join([self._pool.submit(self._compiled, write, lo, hi, sums) for lo, hi in _shares(self.n, self.threads)])

    def write_qd_c(self) -> None:
        self._parallel_compiled(True)

    def read_qd_c(self) -> None:
        self._parallel_compiled(False)

    def read_qd_c_verified(self, checksum: int) -> None:
        """``read_qd_c`` checking every block against ``checksum`` (each holds the same
        bytes) on the thread that read it, as kvtier verifies every read: not a
        baseline, the measure of what verification costs the raw loop."""
        self._parallel_compiled(False, [(self.block, checksum)] * self.n)

    def write_qd(self) -> None:
        self._parallel(os.pwritev)

    def read_qd(self) -> None:
        self._parallel(os.preadv)

    def close(self) -> None:
        self._pool.shutdown()
        os.close(self.fd)
        os.unlink(self.path)
        self.buf = None  # type: ignore[assignment]  # released; a closed baseline is not used again


class ShmCopy:
    """The baseline copies between two POSIX shared-memory buffers, the memory both
    pools are made of. Anonymous memory is no fair baseline here: numpy asks for
    transparent huge pages on large allocations, which shared memory does not get
    where the kernel's ``shmem_enabled`` is ``never``, and fewer TLB misses make
    the same memcpy ~8% faster (``memcpy`` on anonymous memory is reported)."""

    def __init__(self, nbytes: int) -> None:
        self._shm = [shared_memory.SharedMemory(create=True, size=nbytes) for _ in range(2)]
        self.src, self.dst = (np.ndarray(nbytes, dtype=np.uint8, buffer=m.buf) for m in self._shm)
        self.src[:] = np.random.default_rng(2).integers(0, 255, nbytes, dtype=np.uint8)
        self.dst[:] = 0
        self.threads = torch.get_num_threads()  # what the mover's copies get in this process
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="raw-copy")
        # numpy releases the GIL for a plain copy: each thread copies its share at once
        self._parts = [(self.dst[lo:hi], self.src[lo:hi]) for lo, hi in _shares(nbytes, self.threads)]
        self._copier = HostCopier(self.threads)

    def memcpy(self) -> None:
        np.copyto(self.dst, self.src)

    def torch_copy(self) -> None:
        torch.from_numpy(self.dst).copy_(torch.from_numpy(self.src))

    def threads_copy(self) -> None:
        for f in [self._pool.submit(np.copyto, d, s) for d, s in self._parts]:
            f.result()

    def chunks_copy(self) -> None:  # the mover's own loop: one run of rows, in pieces
        self._copier.copy_rows(self.dst.reshape(1, -1), np.zeros(1, np.int64),
                               self.src.reshape(1, -1), np.zeros(1, np.int64))

    def close(self) -> None:
        self._pool.shutdown()
        self._copier.close()
        del self.src, self.dst, self._parts
        for m in self._shm:
            m.close()
            m.unlink()


def best(times: dict[str, list[float]], names: tuple[str, ...]) -> str:
    """The baseline with the smallest median time."""
    return min(names, key=lambda k: float(np.median(times[k])))


__all__ = ["RawODirect", "ShmCopy", "best", "COPY_BASELINES", "WRITE_BASELINES", "READ_BASELINES"]
