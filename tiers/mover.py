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
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

from kvtier.kernels.checksum import block_checksum

from .aligned import aligned_empty
from .nvme import NvmeStore
from .pools import DramPool, HbmPool
from .types import CorruptBlockError, Tier


@dataclass(frozen=True)
class Transfer:
    """One batch of block copies from ``src`` to ``dst`` tier."""

    tid: int
    src: Tier
    dst: Tier
    blocks: np.ndarray
    src_slots: np.ndarray
    dst_slots: np.ndarray
    keys: np.ndarray
    lengths: np.ndarray
    checksums: np.ndarray
    sealed: np.ndarray

    chunks: int = 1  # layer-wise: copy (and report) each block in this many equal parts, in order
    progress: Optional[np.ndarray] = None  # [1] int64: parts done for every block (DRAM -> HBM only)
    seqs: Optional[np.ndarray] = None  # NVMe writes: each block's write sequence, assigned by the owner

    def __post_init__(self) -> None:
        n = self.blocks.size
        for name in ("src_slots", "dst_slots", "keys", "lengths", "checksums", "sealed"):
            arr = getattr(self, name)
            if arr.size != n:
                raise ValueError(f"Transfer.{name} has {arr.size} entries, expected {n}")
            arr.setflags(write=False)
        self.blocks.setflags(write=False)


@dataclass
class Completion:
    tid: int
    src: Tier
    dst: Tier
    blocks: np.ndarray
    ok: np.ndarray
    errors: dict[int, str] = field(default_factory=dict)  # block -> message
    nbytes: int = 0
    seconds: float = 0.0
    checksums: Optional[np.ndarray] = None  # set when the path computed them
    retried: int = 0  # NVMe reads of these blocks that failed once and were read again


PathFn = Callable[["Mover", Transfer, np.ndarray, dict], Optional[np.ndarray]]
PATHS: dict[tuple[Tier, Tier], PathFn] = {}


def path(src: Tier, dst: Tier) -> Callable[[PathFn], PathFn]:
    def deco(fn: PathFn) -> PathFn:
        PATHS[(src, dst)] = fn
        return fn
    return deco


MAX_DIRECT_RUNS = 16  # GPU: up to this many runs go as direct copies; more, as one gather + scatter
MAX_MERGED = 64  # descriptors one copy may merge: bounds how long a merged copy holds the lane


def _mergeable(t: Transfer) -> bool:
    """Memory copies without layer-wise progress: queued ones run as one copy, so
    a burst of descriptors costs one pass (runs of consecutive slots become one
    large copy) instead of a start-up per descriptor."""
    return Tier.NVME not in (t.src, t.dst) and t.progress is None


def _merged(batch: list[Transfer]) -> Transfer:
    cat = lambda name: np.concatenate([getattr(x, name) for x in batch])
    first = batch[0]
    return Transfer(-1, first.src, first.dst, cat("blocks"), cat("src_slots"), cat("dst_slots"), cat("keys"),
                    cat("lengths"), cat("checksums"), cat("sealed"))  # copies only: NVMe I/O never merges


class Mover:
    """Worker threads executing transfers; owner polls completions."""

    def __init__(self, hbm: HbmPool, dram: DramPool, nvme: Optional[NvmeStore],
                 workers: int = 2, queue_depth: int = 64) -> None:
        self.hbm, self.dram, self.nvme = hbm, dram, nvme
        # two lanes, each with its own queue and threads: memory copies (HBM <-> DRAM)
        # never wait behind a long NVMe batch (a promotion an engine is stalled on
        # must not queue behind a demotion to disk), and one copy thread suffices
        # because a large copy already spreads over torch's intra-op threads (on a
        # GPU, over the copy engine); two copy threads only fight for the same cores
        self._lanes: dict[str, "queue.Queue[Optional[Transfer]]"] = {
            lane: queue.Queue(maxsize=queue_depth) for lane in ("copy", "io")}
        self._overflow: dict[str, deque[Transfer]] = {lane: deque() for lane in self._lanes}  # owner's only
        self._done: "queue.Queue[Completion]" = queue.Queue()
        self._in_flight = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._stream = torch.cuda.Stream() if hbm.is_cuda else None
        self._tls = threading.local()  # per worker: blocks whose NVMe read was retried in this batch
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
        out: list[Completion] = []
        try:
            if timeout is None or timeout > 0:
                out.append(self._done.get(timeout=timeout))
            while True:
                out.append(self._done.get_nowait())
        except queue.Empty:
            pass
        return out

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    def drain(self, timeout: Optional[float] = None) -> bool:
        """Wait until every submitted transfer has posted its completion."""
        deadline = None if timeout is None else time.monotonic() + timeout
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
        self._tls.retried = retried
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
    def _sync(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()

    def _copy_rows(self, dst: torch.Tensor, dst_idx: np.ndarray, src: torch.Tensor, src_idx: np.ndarray) -> None:
        """Copy rows ``src[src_idx]`` to ``dst[dst_idx]``. Runs where both sides are
        consecutive slots go as one large copy each: on CPU torch splits a large run
        over its intra-op threads (a numpy copy uses one core); on a GPU a run is one
        DMA straight between the device pool and the pinned host pool. Scattered
        rows on a GPU go as one gather, one transfer and one scatter instead."""
        runs = _runs(dst_idx, src_idx)
        if self._stream is None:
            for di, si, k in runs:
                dst[di: di + k].copy_(src[si: si + k])
            return
        with torch.cuda.stream(self._stream):
            if len(runs) <= MAX_DIRECT_RUNS:
                for di, si, k in runs:
                    dst[di: di + k].copy_(src[si: si + k], non_blocking=True)
            else:
                dst_rows = torch.as_tensor(dst_idx, device=dst.device)
                src_rows = torch.as_tensor(src_idx, device=src.device)
                rows = src.index_select(0, src_rows).to(dst.device, non_blocking=True)
                dst.index_copy_(0, dst_rows, rows)
        self._sync()


def _runs(dst_idx: np.ndarray, src_idx: np.ndarray) -> list[tuple[int, int, int]]:
    """(dst start, src start, length) of each run of rows consecutive on both sides."""
    if dst_idx.size == 0:
        return []
    brk = np.flatnonzero((np.diff(dst_idx) != 1) | (np.diff(src_idx) != 1)) + 1
    starts = np.concatenate(([0], brk))
    ends = np.concatenate((brk, [dst_idx.size]))
    return list(zip(dst_idx[starts].tolist(), src_idx[starts].tolist(), (ends - starts).tolist()))


def _verify(t: Transfer, i: int, buf: np.ndarray, ok: np.ndarray, errors: dict) -> None:
    length = int(t.lengths[i])
    if block_checksum(buf, length) == int(t.checksums[i]):
        ok[i] = True
        errors.pop(int(t.blocks[i]), None)
    else:
        errors[int(t.blocks[i])] = str(CorruptBlockError(
            f"block {int(t.blocks[i])}: NVMe slot {int(t.src_slots[i])} failed its checksum"))


def _wait_all(t: Transfer, futs: list, ok: np.ndarray, errors: dict,
              on_ok: Optional[Callable[[int], None]] = None) -> None:
    for i, fut in futs:
        try:
            fut.result()
        except Exception as e:
            errors[int(t.blocks[i])] = f"{type(e).__name__}: {e}"
            continue
        if on_ok is None:
            ok[i] = True
        else:
            on_ok(i)


@path(Tier.HBM, Tier.DRAM)
def _hbm_to_dram(m: Mover, t: Transfer, ok: np.ndarray, errors: dict) -> None:
    m._copy_rows(m.dram.tensor, t.dst_slots, m.hbm.tensor, t.src_slots)
    ok[:] = True


@path(Tier.DRAM, Tier.HBM)
def _dram_to_hbm(m: Mover, t: Transfer, ok: np.ndarray, errors: dict) -> None:
    """Layer by layer when asked: part c of every block lands before part c+1 starts,
    and ``progress`` says how many parts are in place, so an engine can compute layer
    l while layer l+1 is still arriving. (NVMe reads are all or nothing: a block is
    only trusted once its checksum verified.)"""
    if t.chunks <= 1 or t.progress is None:
        m._copy_rows(m.hbm.tensor, t.dst_slots, m.dram.tensor, t.src_slots)
        ok[:] = True
        return
    part = m.hbm.block_bytes // t.chunks
    for c in range(t.chunks):
        cols = slice(c * part, (c + 1) * part)
        m._copy_rows(m.hbm.tensor[:, cols], t.dst_slots, m.dram.tensor[:, cols], t.src_slots)
        t.progress[0] = c + 1
    ok[:] = True


def _write_nvme(m: Mover, t: Transfer, ok: np.ndarray, errors: dict,
                source: Callable[[int], "np.ndarray | torch.Tensor"]) -> np.ndarray:
    """Write each block with its header. Open blocks have no checksum yet:
    it is computed here from the bytes written and returned to the owner."""
    assert m.nvme is not None
    futs = []
    sums = t.checksums.copy()
    for i in range(t.blocks.size):
        try:
            buf = source(int(t.src_slots[i]))
            if not t.sealed[i]:
                sums[i] = block_checksum(buf, int(t.lengths[i]))
            fut = m.nvme.write(int(t.dst_slots[i]), buf, int(t.keys[i]), int(t.lengths[i]), int(sums[i]),
                               bool(t.sealed[i]), None if t.seqs is None else int(t.seqs[i]))
        except Exception as e:
            errors[int(t.blocks[i])] = f"{type(e).__name__}: {e}"
            continue
        futs.append((i, fut))
    _wait_all(t, futs, ok, errors)
    return sums


@path(Tier.DRAM, Tier.NVME)
def _dram_to_nvme(m: Mover, t: Transfer, ok: np.ndarray, errors: dict) -> np.ndarray:
    return _write_nvme(m, t, ok, errors, m.dram.slot_buffer)


@path(Tier.HBM, Tier.NVME)
def _hbm_to_nvme(m: Mover, t: Transfer, ok: np.ndarray, errors: dict) -> np.ndarray:
    if not m.hbm.is_cuda:
        return _write_nvme(m, t, ok, errors, lambda s: m.hbm._np[s])  # type: ignore[index]
    if m.nvme is not None and m.nvme.backend.name == "kvikio" and bool(t.sealed.all()):
        return _write_nvme(m, t, ok, errors, lambda s: m.hbm.tensor[s])  # GPUDirect

    def staged(s: int) -> np.ndarray:  # bounce through host memory
        host = aligned_empty(m.hbm.slot_stride)
        torch.from_numpy(host).copy_(m.hbm.tensor[s])
        return host

    return _write_nvme(m, t, ok, errors, staged)


def _read_nvme(m: Mover, t: Transfer, ok: np.ndarray, errors: dict,
               target: Callable[[int], np.ndarray], finish: Optional[Callable[[int, np.ndarray], None]] = None) -> None:
    assert m.nvme is not None
    futs, bufs = [], {}
    for i in range(t.blocks.size):
        buf = target(int(t.dst_slots[i]))
        bufs[i] = buf
        try:
            futs.append((i, m.nvme.read(int(t.src_slots[i]), buf)))
        except Exception as e:
            errors[int(t.blocks[i])] = f"{type(e).__name__}: {e}"

    def check(i: int) -> None:
        _verify(t, i, bufs[i], ok, errors)
        if ok[i] and finish is not None:
            finish(int(t.dst_slots[i]), bufs[i])

    _wait_all(t, futs, ok, errors, on_ok=check)
    retried: set = getattr(m._tls, "retried", set())
    for i in np.flatnonzero(~ok).tolist():  # one more read each: only a failure that repeats condemns the copy
        b = int(t.blocks[i])
        retried.add(b)
        try:
            m.nvme.read(int(t.src_slots[i]), bufs[i]).result()
        except Exception as e:
            errors[b] = f"{type(e).__name__}: {e} (and on a second read)"
            continue
        check(i)


@path(Tier.NVME, Tier.DRAM)
def _nvme_to_dram(m: Mover, t: Transfer, ok: np.ndarray, errors: dict) -> None:
    _read_nvme(m, t, ok, errors, m.dram.slot_buffer)


@path(Tier.NVME, Tier.HBM)
def _nvme_to_hbm(m: Mover, t: Transfer, ok: np.ndarray, errors: dict) -> None:
    if not m.hbm.is_cuda:
        # read straight into the (not yet valid) HBM slot, verify in place
        _read_nvme(m, t, ok, errors, lambda s: m.hbm._np[s])  # type: ignore[index]
        return

    def finish(slot: int, host: np.ndarray) -> None:
        # on the mover's stream, which _sync() waits for: a copy from pageable memory
        # can return before its DMA lands, and an engine may read the slot as soon as
        # the completion says it is valid
        with torch.cuda.stream(m._stream):
            m.hbm.tensor[slot].copy_(torch.from_numpy(host), non_blocking=True)

    _read_nvme(m, t, ok, errors, lambda s: aligned_empty(m.hbm.slot_stride), finish)
    m._sync()
