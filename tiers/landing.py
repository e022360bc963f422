"""Applying a transfer that has landed: what the owner keeps of it meanwhile (``Pending``),
several of one path merged into one, and the block table's bookkeeping when every block
of a memory-tier copy has landed.

A copy between HBM and DRAM cannot fail a block once it has started, so the owner's
apply of its completion is the same handful of column updates for every block: the
move is over (``busy``, ``inflight``), the destination copy is valid, the read-failure
count restarts, an HBM slot records whose bytes it holds, and the source slot goes
back to its free list where the source copy is not kept. Where the compiled kernel
was built (``kernels/_land.c``) that is one pass over the blocks; numpy took ~20
passes, each 5-40 us right after a large copy had been through the caches (~280 us
of a 15 ms move of 1024 blocks on a 2-core host). ``land_numpy`` is the same
bookkeeping, for hosts without the kernel and as the reference the tests hold the
kernel to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from .block_table import BlockTable
from .key_index import all_distinct
from .transfer import Completion
from .types import HBM, Tier

try:
    from kvtier.kernels._land import land as _c_land
except ImportError:  # pragma: no cover - exercised where the extension was not built
    _c_land = None


@dataclass
class Pending:
    """What the owner keeps of a transfer in flight, to apply its completion."""

    blocks: np.ndarray
    src: Tier
    dst: Tier
    keep_source: np.ndarray  # per block: keep the source copy
    chunks: int = 1
    progress: Optional[np.ndarray] = None  # parts landed (layer-wise DRAM -> HBM promotions)


def merged(parts: list[tuple[Pending, Completion]]) -> tuple[Pending, Completion]:
    """One pending transfer and its completion for several of one path, applied as one
    (disjoint blocks: a block in flight cannot be moved again)."""
    if len(parts) == 1:
        return parts[0]
    p0, c0 = parts[0]
    cat = np.concatenate
    errors: dict[int, str] = {}
    for _, c in parts:
        errors.update(c.errors)
    blocks = cat([p.blocks for p, _ in parts])
    same = all(c.blocks is p.blocks for p, c in parts)  # (a started copy's completion names its own array)
    return (Pending(blocks, p0.src, p0.dst, cat([p.keep_source for p, _ in parts])),
            Completion(c0.tid, c0.src, c0.dst, blocks if same else cat([c.blocks for _, c in parts]),
                       cat([c.ok for _, c in parts]),
                       errors, sum(c.nbytes for _, c in parts), sum(c.seconds for _, c in parts), None,
                       sum(c.retried for _, c in parts)))


def dropped(blocks: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """The blocks whose source copy goes (``keep`` false), in order."""
    return blocks[:0] if keep.all() else blocks if not keep.any() else blocks[~keep]


def land_numpy(t: BlockTable, inflight: np.ndarray, io_failures: np.ndarray, hbm_slot_ns: Optional[np.ndarray],
               namespace: np.ndarray, blocks: np.ndarray, keep: np.ndarray, src: int, dst: int) -> np.ndarray:
    """The bookkeeping in numpy; returns the blocks whose source slot was freed."""
    if not all_distinct(blocks):
        raise ValueError("land: a block is named twice")
    t.busy[blocks] -= 1
    inflight[blocks] = 0
    t.copies[blocks] |= np.uint8(1 << dst)
    if dst == HBM and hbm_slot_ns is not None:  # an engine of another namespace gets this slot zeroed
        hbm_slot_ns[t.slot[HBM, blocks]] = namespace[blocks]
    io_failures[blocks] = 0  # failures count consecutive reads only
    drop = dropped(blocks, keep)
    t.release_slots(drop, src)
    return drop


def land(t: BlockTable, inflight: np.ndarray, io_failures: np.ndarray, hbm_slot_ns: Optional[np.ndarray],
         namespace: np.ndarray, blocks: np.ndarray, keep: np.ndarray, src: int, dst: int) -> np.ndarray:
    """``land_numpy`` in one compiled pass where the kernel was built (and the source is a
    memory tier: an NVMe slot's release also leaves the NVMe idle list)."""
    free = t.free_slots[src]
    if _c_land is None or free.n_lists != 1 or src not in (0, 1):
        return land_numpy(t, inflight, io_failures, hbm_slot_ns, namespace, blocks, keep, src, dst)
    hbm = dst == HBM and hbm_slot_ns is not None
    _c_land(np.ascontiguousarray(blocks, dtype=np.int64), np.ascontiguousarray(keep, dtype=bool), src, dst,
            t.busy, inflight, t.copies, io_failures, t.slot[src], t.slot_owner[src], free.next, free.prev,
            free.owner, free.lengths, t.slot[HBM] if hbm else None, hbm_slot_ns if hbm else None,
            namespace if hbm else None)
    return dropped(blocks, keep)


__all__ = ["Pending", "dropped", "land", "land_numpy", "merged"]
