"""The remote tier's side of the block lifecycle: placeholder blocks a remote read fills
(``reserve_fetch`` / ``finish_fetch``) and read holds on blocks a remote write reads
(``hold`` / ``unhold``). A base of ``TierManager``, on the owner thread like it."""

from __future__ import annotations

import numpy as np

from .integrity import unreachable_idle
from .moves import TierMoves
from .types import DRAM


class RemoteBlocks(TierMoves):
    def reserve_fetch(self, n: int, ns: int, tier: int = DRAM) -> np.ndarray:
        """Up to ``n`` placeholder blocks, each with a ``tier`` slot a remote read will fill:
        OPEN, unreferenced and busy (nothing moves, evicts, seals or serves them) until
        ``finish_fetch``. Fewer (or none) when slots or table entries run short."""
        t = self.table
        n = min(int(n), t.free_slot_count(tier), len(t.free_blocks))
        if n <= 0:
            return np.zeros(0, dtype=np.int64)
        out = np.fromiter((t.new_block() for _ in range(n)), dtype=np.int64, count=n)
        t.refcount[out] = 0
        t.busy[out] = 1
        self.namespace[out] = ns
        t.assign_slots(out, tier)
        return out

    def finish_fetch(self, blocks: np.ndarray, ok: np.ndarray, keys: np.ndarray, lengths: np.ndarray,
                     checksums: np.ndarray, tier: int = DRAM) -> np.ndarray:
        """Apply a remote read of ``reserve_fetch`` blocks: a verified one becomes a cached
        SEALED block whose one copy is its ``tier`` slot; the others are released. Per block,
        the block now holding its key (the fetched one, or one sealed here meanwhile), or -1."""
        with self.deferring_listeners():  # a listener's error must not leave a placeholder unreleased
            t = self.table
            t.busy[blocks] -= 1
            out = np.full(blocks.size, -1, dtype=np.int64)
            kept = []
            for i, b in enumerate(blocks.tolist()):
                key = int(keys[i])
                existing = t.lookup(key)
                if ok[i] and existing < 0:
                    t.nbytes[b] = int(lengths[i])
                    t.seal(b, key, int(checksums[i]))
                    t.copies[b] |= np.uint8(1 << tier)
                    kept.append(b)
                    out[i] = b
                else:  # an engine may have named its id (a hint, a report): what listeners keep by id goes
                    self._emit("removed", b, -1)
                    t.release_block(b)
                    out[i] = existing
            arr = np.asarray(kept, dtype=np.int64)
            t.refresh_nvme_idle_many(arr)
            self._emit_many("stored", arr, tier)
            return out

    def hold(self, blocks: np.ndarray) -> None:
        """A remote write reads these sealed blocks' bytes (``BlockTable.read_hold``)."""
        self.table.read_hold(blocks, +1)

    def unhold(self, blocks: np.ndarray) -> None:
        """The remote write is done: a block that nothing else holds and no lookup reaches
        (a clear detached it while it was read) is released now, as ``free`` would."""
        self.table.read_hold(blocks, -1)
        self._reap(np.unique(blocks))

    def _reap(self, arr: np.ndarray) -> None:
        """Release blocks no lookup reaches whose last reference, pin or hold just went."""
        t = self.table
        dead = arr[unreachable_idle(t, self.corrupt, arr)]
        for b in dead.tolist():
            self._emit("removed", b, -1)
            t.release_block(b)


__all__ = ["RemoteBlocks"]
