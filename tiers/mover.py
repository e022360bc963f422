"""Asynchronous batched block transfers between tiers.

Modelled on SGLang's cache controller: the metadata owner submits immutable
``Transfer`` descriptors (batched slot index arrays) to bounded queues, one
per lane (memory copies; NVMe I/O), so a promotion never waits behind a disk
batch; worker threads execute them and post a ``Completion`` with a per-block
success mask. Copies queued back to back on one path run as one pass (a
watermark burst costs one copy, not one start-up per descriptor) and still
complete descriptor by descriptor. Workers never touch block metadata; the
owner applies completions when it polls. Every NVMe read is verified against
the block's recorded checksum before the completion says it succeeded; a read
that fails or does not verify is read once more before it counts as failed (a
bit flipped in flight or a transient EIO must not condemn a good disk copy).
Where both memory pools are host memory, a copy of whole rows skips the lane:
it starts on the copy kernel's threads at submit and the owner collects it
when it polls (``started_copies``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from typing import Optional

import numpy as np
import torch

from .hostcopy import HostCopier, row_runs
from .nvme import NvmeStore
from .paths import PATHS
from .pools import BounceBuffers, DramPool, HbmPool
from .started_copies import StartedCopies
from .transfer import Completion, Transfer
from .types import Tier

MAX_DIRECT_RUNS = 16  # GPU: up to this many runs go as direct copies; more, as one gather + scatter
MAX_MERGED = 64  # descriptors one copy may merge: bounds how long a merged copy holds the lane
BOUNCE_BYTES = 64 << 20  # pinned host buffers for NVMe -> HBM without GPUDirect (4 to 64 slots)


def _mergeable(t: Transfer) -> bool:
    """Memory copies without layer-wise progress: queued ones run as one copy, so
    a burst of descriptors costs one pass (runs of consecutive slots become one
    large copy) instead of a start-up per descriptor."""
    return Tier.NVME not in (t.src, t.dst) and t.progress is None


def _merged(batch: list[Transfer]) -> Transfer:
    first = batch[0]
    cat = lambda name: np.concatenate([getattr(x, name) for x in batch])
    opt = lambda name: None if getattr(first, name) is None else cat(name)
    return Transfer(-1, first.src, first.dst, cat("blocks"), cat("src_slots"), cat("dst_slots"), opt("keys"),
                    cat("lengths"), opt("checksums"), opt("sealed"))  # copies only: NVMe I/O never merges


class Mover:
    """Worker threads executing transfers; owner polls completions."""

    def __init__(self, hbm: HbmPool, dram: DramPool, nvme: Optional[NvmeStore],
                 workers: int = 2, queue_depth: int = 64) -> None:
        self.hbm, self.dram, self.nvme = hbm, dram, nvme
        # two lanes, each with its own queue and threads: memory copies (HBM <-> DRAM)
        # never wait behind a long NVMe batch (a promotion an engine is stalled on
        # must not queue behind a demotion to disk), and one copy thread suffices
        # because a large copy already spreads over helper threads (``HostCopier``,
        # as many in all as torch has intra-op threads; on a GPU, over the copy
        # engine); two copy threads only fight for the same cores
        self._lanes: dict[str, "queue.Queue[Optional[Transfer]]"] = {
            lane: queue.Queue(maxsize=queue_depth) for lane in ("copy", "io")}
        self._overflow: dict[str, deque[Transfer]] = {lane: deque() for lane in self._lanes}  # owner's only
        self._done: "queue.Queue[Completion]" = queue.Queue()
        self._in_flight = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self.stream = torch.cuda.Stream() if hbm.is_cuda else None
        self.host_copier = HostCopier(torch.get_num_threads()) if self.stream is None else None
        # NVMe -> device reads that cannot go GPUDirect bounce through these (allocated
        # once, pinned; a pageable buffer per block would make every copy synchronous)
        self.bounce = (BounceBuffers(min(64, max(4, BOUNCE_BYTES // hbm.slot_stride)), hbm.slot_stride)
                       if hbm.is_cuda and nvme is not None else None)
        self.tls = threading.local()  # per worker: blocks whose NVMe read was retried in this batch
        # host copies of whole rows begin on the copy kernel's threads at submit, no lane worker
        self.started = StartedCopies(self, self.host_copier) if self.host_copier is not None else None
        self.start_early = True
        counts = {"copy": 1, "io": max(1, workers)}
        self._threads = [(lane, threading.Thread(target=self._run, args=(self._lanes[lane],),
                                                 name=f"kvtier-mover-{lane}-{i}", daemon=True))
                         for lane, k in counts.items() for i in range(k)]
        for _, t in self._threads:
            t.start()

    @staticmethod
    def lane(src: Tier, dst: Tier) -> str:
        return "io" if Tier.NVME in (src, dst) else "copy"

    # -- owner side --------------------------------------------------------
    def submit(self, t: Transfer) -> None:
        """Queue a transfer without ever blocking the owner: a full lane queue
        (a stalled disk) parks it in the lane's overflow, in order, until the
        owner's next ``poll`` finds room."""
        if (t.src, t.dst) not in PATHS:
            raise ValueError(f"no transfer path {t.src.name}->{t.dst.name}")
        if self.start_early and self.started is not None and self.started.start(t):
            return  # collected by ``poll``
        with self._lock:
            self._in_flight += 1
        lane = self.lane(t.src, t.dst)
        self._overflow[lane].append(t)
        self._flush(lane)

    def _flush(self, lane: str) -> None:
        """Move parked transfers into the lane's queue while it has room (owner thread)."""
        parked, q = self._overflow[lane], self._lanes[lane]
        while parked:
            try:
                q.put_nowait(parked[0])
            except queue.Full:
                return
            parked.popleft()

    def backlog(self) -> int:
        """Transfers parked because their lane's queue was full."""
        return sum(len(d) for d in self._overflow.values())

    def poll(self, timeout: Optional[float] = 0.0) -> list[Completion]:
        """Completions ready now (waits up to ``timeout`` for the first)."""
        for lane in self._overflow:
            self._flush(lane)
        out: list[Completion] = self.started.harvest() if self.started is not None else []
        if not out and (timeout is None or timeout > 0):
            out = self._wait_first(timeout)
        try:
            while True:
                out.append(self._done.get_nowait())
        except queue.Empty:
            pass
        return out

    def _wait_first(self, timeout: Optional[float]) -> list[Completion]:
        """Wait up to ``timeout`` for a lane's completion or a started copy, whichever is first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        started = self.started if self.started is not None and len(self.started) else None
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                if started is None:
                    return [self._done.get(timeout=left)]
                return [self._done.get_nowait()]  # a lane's, already waiting, first
            except queue.Empty:
                if started is None:
                    return []
            with self._lock:
                lanes_busy = self._in_flight > 0
            cap = 1.0 if left is None else left
            started.wait_first(min(1e-3, cap) if lanes_busy else cap)  # both kinds: short slices
            got = started.harvest()
            if got or left == 0.0:
                return got

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight + (len(self.started) if self.started is not None else 0)

    def drain(self, timeout: Optional[float] = None) -> bool:
        """Wait until every submitted transfer has posted its completion (a started copy:
        has landed, for the next ``poll`` to collect)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.started is not None and not self.started.wait(timeout):
            return False
        while True:
            for lane in self._overflow:
                self._flush(lane)
            with self._idle:
                if not self._in_flight:
                    return True
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(0.05 if left is None else min(left, 0.05))  # parked ones need flushing

    def close(self) -> None:
        self.drain()
        for lane, _ in self._threads:
            self._lanes[lane].put(None)
        for _, t in self._threads:
            t.join()
        if self.bounce is not None:
            self.bounce.close()
        if self.host_copier is not None:
            self.host_copier.close()

    # -- worker side -------------------------------------------------------
    def _run(self, todo: "queue.Queue[Optional[Transfer]]") -> None:
        carried: list[Optional[Transfer]] = []  # taken while merging, not mergeable: next
        while True:
            t = carried.pop() if carried else todo.get()
            if t is None:
                return
            batch = [t]
            while _mergeable(t) and len(batch) < MAX_MERGED:
                try:
                    nxt = todo.get_nowait()
                except queue.Empty:
                    break
                if nxt is not None and _mergeable(nxt) and (nxt.src, nxt.dst) == (t.src, t.dst):
                    batch.append(nxt)
                else:
                    carried.append(nxt)
                    break
            for c in self._execute(batch):
                self._done.put(c)
                with self._idle:
                    self._in_flight -= 1
                    if self._in_flight == 0:
                        self._idle.notify_all()

    def _execute(self, batch: list[Transfer]) -> list[Completion]:
        """Run ``batch`` (transfers queued back to back on one path) as one transfer,
        then report a completion per descriptor, each with its own blocks."""
        t = batch[0] if len(batch) == 1 else _merged(batch)
        ok = np.zeros(t.blocks.size, dtype=bool)
        errors: dict[int, str] = {}
        start = time.perf_counter()
        sums = None
        retried: set[int] = set()
        self.tls.retried = retried
        try:
            sums = PATHS[(t.src, t.dst)](self, t, ok, errors)
        except Exception as e:  # a path bug must not kill the worker
            for i in np.flatnonzero(~ok):
                errors.setdefault(int(t.blocks[i]), f"{type(e).__name__}: {e}")
            ok[:] = False
        seconds = time.perf_counter() - start
        out: list[Completion] = []
        lo = 0
        for part in batch:
            hi = lo + part.blocks.size
            good = ok[lo:hi]
            nbytes = int(part.lengths[good].sum())
            mine = {b: errors[b] for b in part.blocks.tolist() if b in errors} if errors else {}
            share = seconds * part.blocks.size / max(1, t.blocks.size)
            again = sum(1 for b in part.blocks.tolist() if b in retried) if retried else 0
            out.append(Completion(part.tid, part.src, part.dst, part.blocks, good.copy(), mine, nbytes, share,
                                  None if sums is None else sums[lo:hi].copy(), again))
            lo = hi
        return out

    # helpers used by paths
    def sync(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def copy_rows(self, dst: torch.Tensor, dst_idx: np.ndarray, src: torch.Tensor, src_idx: np.ndarray,
                  sync: bool = True) -> None:
        """Copy rows ``src[src_idx]`` to ``dst[dst_idx]``. Runs where both sides are
        consecutive slots go as one large copy each: on CPU in chunks that this
        thread and idle helpers pull (``HostCopier``: no OpenMP spin-wait, no static
        split that waits for its slowest share); on a GPU a run is one DMA straight
        between the device pool and the pinned host pool. Scattered rows on a GPU
        go as one gather, one transfer and one scatter instead. On a GPU,
        ``sync=False`` leaves the copy queued on ``stream`` (the caller records an
        event after it); on CPU copies are always done on return."""
        if self.host_copier is not None:
            self.host_copier.copy_rows(dst.numpy(), dst_idx, src.numpy(), src_idx)
            return
        runs = list(zip(*(a.tolist() for a in row_runs(dst_idx, src_idx))))
        with torch.cuda.stream(self.stream):
            if len(runs) <= MAX_DIRECT_RUNS:
                for di, si, k in runs:
                    dst[di: di + k].copy_(src[si: si + k], non_blocking=True)
            else:
                dst_rows = torch.as_tensor(dst_idx, device=dst.device)
                src_rows = torch.as_tensor(src_idx, device=src.device)
                rows = src.index_select(0, src_rows).to(dst.device, non_blocking=True)
                dst.index_copy_(0, dst_rows, rows)
        if sync:
            self.sync()


__all__ = ["Mover", "Transfer", "Completion", "MAX_DIRECT_RUNS"]
