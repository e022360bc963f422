"""Copy paths between tiers, one function a (src, dst) pair, in a registry.

Each path runs on a mover worker thread: it copies the blocks of one
``Transfer``, marks each block's success in ``ok`` and names failures in
``errors``. NVMe reads are verified against the block's checksum and read once
more before they count as failed; NVMe writes of open blocks return the
checksums of the bytes written. Paths see the mover only through ``CopyEngine``.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterator, Optional, Protocol, Sequence, Union

import numpy as np
import torch

from kvtier.kernels.checksum import block_checksum

from .aligned import aligned_empty
from .nvme import NvmeStore
from .pools import BounceBuffers, DramPool, HbmPool
from .transfer import Transfer
from .types import CorruptBlockError, Tier


class CopyEngine(Protocol):
    """What a path needs of the mover: the pools, the store, its stream and row copies."""

    hbm: HbmPool
    dram: DramPool
    nvme: Optional[NvmeStore]
    stream: "Optional[torch.cuda.Stream]"
    bounce: Optional[BounceBuffers]  # pinned host buffers: NVMe -> device without GPUDirect
    tls: threading.local  # per worker: ``retried``, the blocks read a second time

    def copy_rows(self, dst: torch.Tensor, dst_idx: np.ndarray, src: torch.Tensor, src_idx: np.ndarray,
                  sync: bool = True) -> None: ...

    def sync(self) -> None: ...


Buf = Union[np.ndarray, torch.Tensor]  # host bytes, or a device slot (kvikio reads and checks it there)
PathFn = Callable[[CopyEngine, Transfer, np.ndarray, dict], Optional[np.ndarray]]
PATHS: dict[tuple[Tier, Tier], PathFn] = {}


def path(src: Tier, dst: Tier) -> Callable[[PathFn], PathFn]:
    def deco(fn: PathFn) -> PathFn:
        PATHS[(src, dst)] = fn
        return fn
    return deco


def _split(idx: Sequence[int], k: int) -> list[Sequence[int]]:
    """``idx`` in at most ``k`` contiguous shares, sizes within one of each other."""
    k = max(1, min(len(idx), k))
    bounds = [len(idx) * j // k for j in range(k + 1)]
    return [idx[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:]) if hi > lo]


def _outcomes(calls: list) -> Iterator[tuple[int, Optional[BaseException]]]:
    """(index, error or None) of every item of batched I/O calls ``(indices, future)``;
    a future that failed as a whole fails each of its items."""
    for idx, fut in calls:
        try:
            failures = fut.result()
        except Exception as e:
            failures = [e] * len(idx)
        yield from zip(idx, failures)


def _io_threads(m: CopyEngine) -> int:
    assert m.nvme is not None
    return int(getattr(m.nvme.backend, "threads", 8))


# paths that copy whole rows between the two memory pools: (dst pool, src pool) of each. Where
# the pools are host memory the owner starts such a copy as it submits it (``StartedCopies``)
ROW_POOLS: dict[tuple[Tier, Tier], Callable[[CopyEngine], tuple[Union[HbmPool, DramPool], Union[HbmPool, DramPool]]]] = {
    (Tier.HBM, Tier.DRAM): lambda m: (m.dram, m.hbm),
    (Tier.DRAM, Tier.HBM): lambda m: (m.hbm, m.dram),
}


def whole_rows(t: Transfer) -> bool:
    """Does ``t`` copy whole rows between the memory pools (not layer by layer)?"""
    return (t.src, t.dst) in ROW_POOLS and (t.chunks <= 1 or t.progress is None)


def _copy_whole_rows(m: CopyEngine, t: Transfer, ok: np.ndarray) -> None:
    dst, src = ROW_POOLS[(t.src, t.dst)](m)
    m.copy_rows(dst.tensor, t.dst_slots, src.tensor, t.src_slots)
    ok[:] = True


@path(Tier.HBM, Tier.DRAM)
def _hbm_to_dram(m: CopyEngine, t: Transfer, ok: np.ndarray, errors: dict) -> None:
    _copy_whole_rows(m, t, ok)


@path(Tier.DRAM, Tier.HBM)
def _dram_to_hbm(m: CopyEngine, t: Transfer, ok: np.ndarray, errors: dict) -> None:
    """Layer by layer when asked: part c of every block lands before part c+1 starts,
    and ``progress`` says how many parts are in place, so an engine can compute layer
    l while layer l+1 is still arriving. (NVMe reads are all or nothing: a block is
    only trusted once its checksum verified.)"""
    progress = t.progress
    if whole_rows(t) or progress is None:
        _copy_whole_rows(m, t, ok)
        return
    part = m.hbm.block_bytes // t.chunks
    cols = [slice(c * part, (c + 1) * part) for c in range(t.chunks)]
    if m.stream is None:  # host pool: each part is in place when its copy returns
        for c, col in enumerate(cols):
            m.copy_rows(m.hbm.tensor[:, col], t.dst_slots, m.dram.tensor[:, col], t.src_slots)
            progress[0] = c + 1
        ok[:] = True
        return
    # device pool: every part queued on the mover's stream at once, an event after each;
    # progress follows the events (no stream synchronisation per part)
    events = []
    for col in cols:
        m.copy_rows(m.hbm.tensor[:, col], t.dst_slots, m.dram.tensor[:, col], t.src_slots, sync=False)
        ev = torch.cuda.Event()
        ev.record(m.stream)
        events.append(ev)
    for c, ev in enumerate(events):
        ev.synchronize()
        progress[0] = c + 1
    ok[:] = True


def _write_nvme(m: CopyEngine, t: Transfer, ok: np.ndarray, errors: dict,
                source: Callable[[int], "np.ndarray | torch.Tensor"], rows: Optional[np.ndarray] = None) -> np.ndarray:
    """Write each block with its header. Open blocks have no checksum yet:
    it is computed here from the bytes written and returned to the owner.

    The blocks go to the backend in as many shares as it has threads, each share one
    call that writes its blocks one after the other: as many writes in flight as with
    a call per block, without a future and a thread hand-off per block (on a small
    host that Python cost 20-25% of the disk's write bandwidth). Where the source
    slots are ``rows`` of one host array, a share goes as arrays (``write_rows``);
    otherwise block by block through ``source(slot)``."""
    assert m.nvme is not None
    keys, checksums, sealed = t.header()
    sums = checksums.copy()
    seqs = m.nvme.reserve_seqs(t.blocks.size) if t.seqs is None else t.seqs
    owners = np.zeros(t.blocks.size, dtype=np.uint64) if t.owners is None else t.owners
    calls: list = []
    if rows is not None:  # as arrays, one share of consecutive slots an I/O thread
        for i in np.flatnonzero(~sealed.astype(bool)).tolist():
            try:
                sums[i] = block_checksum(source(int(t.src_slots[i])), int(t.lengths[i]))
            except Exception as e:
                errors[int(t.blocks[i])] = f"{type(e).__name__}: {e}"
        todo = np.array([i for i in range(t.blocks.size) if int(t.blocks[i]) not in errors] if errors
                        else np.arange(t.blocks.size), dtype=np.int64)
        fields = {"key": keys[todo], "length": t.lengths[todo], "checksum": sums[todo], "sealed": sealed[todo],
                  "seq": seqs[todo], "owner": owners[todo]}
        try:
            parts = m.nvme.write_rows(t.dst_slots[todo], rows, t.src_slots[todo], fields, _io_threads(m))
            calls = [(todo[items].tolist(), fut) for items, fut in parts]
        except Exception as e:  # refused before any I/O
            for i in todo.tolist():
                errors[int(t.blocks[i])] = f"{type(e).__name__}: {e}"
    else:
        for share in _split(range(t.blocks.size), _io_threads(m)):
            mine, items = [], []
            for i in share:  # each block fails alone
                try:
                    buf = source(int(t.src_slots[i]))
                    if not sealed[i]:
                        sums[i] = block_checksum(buf, int(t.lengths[i]))
                    items.append((int(t.dst_slots[i]), buf, int(keys[i]), int(t.lengths[i]), int(sums[i]),
                                  bool(sealed[i]), int(seqs[i]), int(owners[i])))
                    mine.append(i)
                except Exception as e:
                    errors[int(t.blocks[i])] = f"{type(e).__name__}: {e}"
            if items:
                try:
                    calls.append((mine, m.nvme.write_many(items)))
                except Exception as e:
                    for i in mine:
                        errors[int(t.blocks[i])] = f"{type(e).__name__}: {e}"
    for i, err in _outcomes(calls):
        if err is None:
            ok[i] = True
        else:
            errors[int(t.blocks[i])] = f"{type(err).__name__}: {err}"
    return sums


@path(Tier.DRAM, Tier.NVME)
def _dram_to_nvme(m: CopyEngine, t: Transfer, ok: np.ndarray, errors: dict) -> np.ndarray:
    return _write_nvme(m, t, ok, errors, m.dram.slot_buffer, m.dram.host_array)


@path(Tier.HBM, Tier.NVME)
def _hbm_to_nvme(m: CopyEngine, t: Transfer, ok: np.ndarray, errors: dict) -> np.ndarray:
    if not m.hbm.is_cuda:
        return _write_nvme(m, t, ok, errors, m.hbm.host_slot, m.hbm.host_array)
    if m.nvme is not None and m.nvme.backend.name == "kvikio" and bool(t.header()[2].all()):
        return _write_nvme(m, t, ok, errors, lambda s: m.hbm.tensor[s])  # GPUDirect

    def staged(s: int) -> np.ndarray:  # bounce through host memory
        host = aligned_empty(m.hbm.slot_stride)
        torch.from_numpy(host).copy_(m.hbm.tensor[s])
        return host

    return _write_nvme(m, t, ok, errors, staged)


def _read_nvme(m: CopyEngine, t: Transfer, ok: np.ndarray, errors: dict, target: Callable[[int], Buf],
               finish: Optional[Callable[[int, Buf], None]] = None, which: Optional[Sequence[int]] = None,
               rows: Optional[np.ndarray] = None) -> None:
    """Read blocks ``which`` (default all) of ``t`` into ``target(dst slot)`` (or, given
    ``rows``, the host array of the dst slots, as arrays), each verified against its
    checksum on the I/O thread that read it (a failure is read once more), then
    ``finish(dst slot, buffer)`` the good ones on this thread.

    Like writes, the blocks go to the backend in one share per I/O thread: the
    checksum (about as fast as the disk on a small host) then overlaps the other
    threads' reads instead of running after all of them on the mover's thread."""
    todo = list(range(t.blocks.size) if which is None else which)
    bufs = None if rows is not None else {i: target(int(t.dst_slots[i])) for i in todo}
    _read_verified(m, t, todo, bufs, rows, ok, errors, "")
    if finish is not None and bufs is not None:
        for i in todo:
            if ok[i]:
                finish(int(t.dst_slots[i]), bufs[i])
    again = [i for i in todo if not ok[i]]  # one more read each: only a failure that repeats condemns the copy
    if not again:
        return
    retried: set = getattr(m.tls, "retried", set())
    retried.update(int(t.blocks[i]) for i in again)
    _read_verified(m, t, again, bufs, rows, ok, errors, " (and on a second read)")
    if finish is not None and bufs is not None:
        for i in again:
            if ok[i]:
                finish(int(t.dst_slots[i]), bufs[i])


def _read_verified(m: CopyEngine, t: Transfer, idx: Sequence[int], bufs: Optional[dict[int, Buf]],
                   rows: Optional[np.ndarray], ok: np.ndarray, errors: dict, again: str) -> None:
    """One verified read of blocks ``idx`` into ``bufs`` (None: into ``rows``, as arrays):
    ``ok[i]`` only if the bytes read match the block's checksum; otherwise its error
    (``again``: said of a retry)."""
    assert m.nvme is not None
    checksums = t.header()[1]
    calls: list = []
    if bufs is None:  # into the pool's rows, as arrays, one share of consecutive slots an I/O thread
        assert rows is not None
        mine = np.asarray(idx, dtype=np.int64)
        try:
            parts = m.nvme.read_rows(t.src_slots[mine], rows, t.dst_slots[mine], t.lengths[mine],
                                     checksums[mine], _io_threads(m))
            calls = [(mine[items].tolist(), fut) for items, fut in parts]
        except Exception as e:
            for i in mine.tolist():
                errors[int(t.blocks[i])] = f"{type(e).__name__}: {e}{again}"
    else:
        for share in _split(idx, _io_threads(m)):
            items = [(int(t.src_slots[i]), bufs[i], int(t.lengths[i]), int(checksums[i])) for i in share]
            try:
                calls.append((share, m.nvme.read_checked(items)))
            except Exception as e:
                for i in share:
                    errors[int(t.blocks[i])] = f"{type(e).__name__}: {e}{again}"
    for i, err in _outcomes(calls):
        b = int(t.blocks[i])
        if err is None:
            ok[i] = True
            errors.pop(b, None)
        elif isinstance(err, CorruptBlockError):
            errors[b] = f"block {b}: {err}"
        else:
            errors[b] = f"{type(err).__name__}: {err}{again}"


@path(Tier.NVME, Tier.DRAM)
def _nvme_to_dram(m: CopyEngine, t: Transfer, ok: np.ndarray, errors: dict) -> None:
    _read_nvme(m, t, ok, errors, m.dram.slot_buffer, rows=m.dram.host_array)


@path(Tier.NVME, Tier.HBM)
def _nvme_to_hbm(m: CopyEngine, t: Transfer, ok: np.ndarray, errors: dict) -> None:
    if not m.hbm.is_cuda:
        # read straight into the (not yet valid) HBM slot, verify in place
        _read_nvme(m, t, ok, errors, m.hbm.host_slot, rows=m.hbm.host_array)
        return
    assert m.nvme is not None
    if m.nvme.backend.name == "kvikio":
        # GPUDirect: into the (not yet valid) device slot, verified there by the device
        # checksum; kvikio's read has landed when its future completes
        _read_nvme(m, t, ok, errors, lambda s: m.hbm.tensor[s])
        return
    assert m.bounce is not None

    def land(slot: int, host: np.ndarray) -> Optional[torch.cuda.Event]:
        # on the mover's stream, which _sync() waits for: an engine may read the slot
        # as soon as the completion says it is valid; the event frees the buffer
        with torch.cuda.stream(m.stream):
            m.hbm.tensor[slot].copy_(torch.from_numpy(host), non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(m.stream)
        return ev

    read_bounced(m, t, ok, errors, m.bounce, land)
    m.sync()


def read_bounced(m: CopyEngine, t: Transfer, ok: np.ndarray, errors: dict, pool: BounceBuffers,
                 land: Callable[[int, np.ndarray], Optional[torch.cuda.Event]]) -> None:
    """NVMe -> device through ``pool``'s host buffers, as many blocks at a time as
    buffers are free: each is read and verified in host memory exactly as on the
    CPU path, then ``land(dst slot, buffer)`` starts its copy to the device and
    returns the event that frees the buffer (None: the copy is already done)."""
    todo = list(range(t.blocks.size))
    while todo:
        held = pool.take(len(todo))
        window, todo = todo[: len(held)], todo[len(held):]
        _bounce_window(m, t, ok, errors, pool, land, dict(zip((int(t.dst_slots[i]) for i in window), held)), window)


def _bounce_window(m: CopyEngine, t: Transfer, ok: np.ndarray, errors: dict, pool: BounceBuffers,
                   land: Callable[[int, np.ndarray], Optional[torch.cuda.Event]], buf_of: dict[int, int],
                   window: list[int]) -> None:
    """One window of ``read_bounced``: ``buf_of`` maps each dst slot to its buffer,
    and every buffer goes back, with its copy's event, whatever happens."""
    done: dict[int, Optional[torch.cuda.Event]] = {}

    def finish(slot: int, host: Buf) -> None:
        assert isinstance(host, np.ndarray)
        done[slot] = land(slot, host)

    try:
        _read_nvme(m, t, ok, errors, lambda s: pool.array[buf_of[s]], finish, which=window)
    finally:
        for slot, b in buf_of.items():
            pool.give(b, done.get(slot))


__all__ = ["CopyEngine", "PATHS", "PathFn", "read_bounced"]
