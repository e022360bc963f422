"""Planning a memory-tier move's common case in one compiled pass (``kernels/_plan.c``).

Most moves between HBM and DRAM name blocks that are live, idle, each once, with a copy
in the source tier and none in the destination, unpinned where the source copy goes,
and the destination has the free slots: the numpy path (``TierMoves.check_blocks`` and
``_move``) then does ~25 calls of bookkeeping before the copy can start, each 5-20 us
right after a large copy had been through the caches (~300 us before the first byte of
a 64 MiB descriptor moved, measured on a 2-core host). The kernel checks every block
and, only if all pass, takes the destination slots off the front of the free list (as
``IndexLists.pop_front_n``) and marks the blocks moving, in one pass. Any other case
changes nothing and goes the numpy way, which refuses the move or plans what is left
of it, so a request answers the same either way (the tests hold the two paths to equal
tables and transfers over random histories).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from .block_table import NIL, BlockTable
from .types import FREE, NVME, SEALED

try:
    from kvtier.kernels._plan import plan as _c_plan
except ImportError:  # pragma: no cover - exercised where the extension was not built
    _c_plan = None

# (src_slots, dst_slots, lengths, keep, any block with an NVMe copy)
Planned = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, bool]


def plan_common(t: BlockTable, inflight: np.ndarray, blocks: object, keep_source: bool, src: int, dst: int,
                tid: int) -> Optional[Planned]:
    """The move of ``blocks`` planned and marked (dst slots taken, busy 1, inflight ``tid``)
    if every block is the common case and the kernel was built; else None, nothing changed."""
    if _c_plan is None or NVME in (src, dst) or not isinstance(blocks, np.ndarray) or blocks.ndim != 1:
        return None
    if blocks.size == 0 or blocks.dtype.kind not in "iu" or t.free_slots[dst].n_lists != 1:
        return None
    blocks = np.ascontiguousarray(blocks, dtype=np.int64)
    free = t.free_slots[dst]
    out = np.empty((3, blocks.size), dtype=np.int64)
    keep = np.empty(blocks.size, dtype=bool)
    nvme = _c_plan(blocks, keep_source, src, dst, tid, FREE, SEALED, t.state, t.copies, t.busy, t.pins, inflight,
                   t.slot[src], t.slot[dst], t.slot_owner[dst], free.next, free.prev, free.owner, free.lengths,
                   t.nbytes, out[0], out[1], out[2], keep)
    if nvme is None:
        return None
    return out[0], out[1], out[2], keep, bool(nvme)


def unplan(t: BlockTable, inflight: np.ndarray, blocks: np.ndarray, dst: int, marked: bool) -> None:
    """Undo a plan whose transfer was never submitted (its submit raised): the destination
    slots go back to the free list's front in their order, as they were taken, and where the
    plan had ``marked`` the blocks moving (the compiled path does so before submitting) they
    are idle again; nothing is left that a pending transfer does not account for."""
    slots = t.slot[dst, blocks].astype(np.int64)
    t.slot_owner[dst][slots] = NIL
    t.slot[dst, blocks] = NIL
    free = t.free_slots[dst]
    for s in slots[::-1].tolist():
        free.push_front(s)
    if marked:
        t.busy[blocks] -= 1
        inflight[blocks] = 0


__all__ = ["Planned", "plan_common", "unplan"]
