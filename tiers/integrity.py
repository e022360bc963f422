"""What a bad NVMe copy does to a block and its key.

A read that fails its checksum twice (the mover reads once more before it
gives up) means the copy on disk is bad. If the block has another copy, the
disk copy is simply dropped. If it was the only one, the block is marked
corrupt (never served) and its key is detached from the key index: a lookup
then misses, so the engine recomputes, and its next seal of the key makes a
fresh block instead of folding into the bad one. The corrupt block itself
stays until its holders let go, so nobody's reference dangles.

Reads that fail outright (EIO, a short read) ``MAX_READ_FAILURES`` times in a row
give the block up the same way, short of marking it corrupt: its acquires fail, and
its key is detached so that the engine's recomputed seal is kept, not folded into a
block nobody can read.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Optional

import numpy as np

from .aligned import aligned_empty
from .block_table import BlockTable
from .nvme import NvmeStore
from .types import OPEN, SEALED, CorruptBlockError, Tier

READ_ATTEMPTS = 2  # a synchronous NVMe read (``TierManager.read``): once, then once more
MAX_READ_FAILURES = 3  # failed promotions of one block in a row before it is given up


def quarantine(t: BlockTable, corrupt: np.ndarray, counters: Counter[str],
               emit: Callable[[str, int, int], None], b: int) -> None:
    """A copy of ``b`` failed its checksum (twice): never serve it."""
    if bin(int(t.copies[b])).count("1") >= 2 and t.has_copy(b, Tier.NVME):
        t.release_slot(b, Tier.NVME)
        emit("removed", b, Tier.NVME)
    else:
        corrupt[b] = True
        counters["keys_detached"] += int(t.detach_key(b))
    counters["corrupt_copies"] += 1


def count_read_failure(t: BlockTable, io_failures: np.ndarray, counters: Counter[str], b: int) -> None:
    """A promotion of ``b`` failed (its source copy stays): at the limit with no HBM copy,
    its key goes (``BlockTable.detach_key``), so a re-seal makes a readable block."""
    io_failures[b] = min(255, int(io_failures[b]) + 1)
    if io_failures[b] >= MAX_READ_FAILURES and not t.has_copy(b, Tier.HBM):
        counters["keys_detached"] += int(t.detach_key(b))


def read_nvme_verified(nvme: NvmeStore, counters: Counter[str], b: int, slot: int, length: int,
                       checksum: int) -> bytes:
    """Payload of ``b`` from NVMe ``slot``, checked against ``checksum`` on the I/O thread
    that read it; a failed or mismatching read is read again before it raises."""
    buf = aligned_empty(nvme.data_stride)
    err: Optional[BaseException] = None
    for attempt in range(READ_ATTEMPTS):
        if attempt:
            counters["nvme_read_retries"] += 1
        err = nvme.read_checked([(slot, buf, length, checksum)]).result()[0]
        if err is None:
            return bytes(buf[:length])
        if isinstance(err, CorruptBlockError):
            err = CorruptBlockError(f"block {b}: {err}")
    assert err is not None
    raise err


def unindexed(t: BlockTable, corrupt: np.ndarray) -> np.ndarray:
    """Per block: must not be named in a slot index (corrupt, or its key was taken)."""
    return corrupt | t.detached


def unreachable_idle(t: BlockTable, corrupt: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """Per block of ``blocks``: nothing holds, pins or moves it and no lookup reaches it (open,
    or sealed out of the key index and not corrupt), so it is released rather than cached."""
    st = t.state[blocks]
    sealed = st == SEALED
    if sealed.all() and not t.detached[blocks].any():  # the common case after a move: all reachable
        return np.zeros(blocks.size, dtype=bool)
    hidden = sealed & t.detached[blocks] & ~corrupt[blocks]
    return (t.refcount[blocks] == 0) & (t.pins[blocks] == 0) & (t.busy[blocks] == 0) & ((st == OPEN) | hidden)

