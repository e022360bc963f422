"""Who recovered blocks belong to: a restart gives each block back to the namespace that sealed it.

Every NVMe copy carries its namespace's *owner*, a stable identity (a hash of the
namespace's name and block geometry, set by the daemon; 0 for the library's default
namespace). Namespace ids are this run's own, handed out as engines register, so a
recovered block cannot keep the id it had: it waits under ``UNCLAIMED_NS``, which no
engine has (nobody finds it by key or names it by id), until an engine of its owner
registers and ``claim`` gives it that namespace's id of this run. Before this, recovered
blocks all went to namespace 0: a default-namespace engine could name another tenant's
block by id and read it, a 2 KiB block was a 4 KiB engine's hit, and a named namespace
never found its own blocks again.
"""

from __future__ import annotations

import numpy as np

from .block_table import BlockTable
from .types import SEALED, UNCLAIMED_NS


class Unclaimed:
    """Recovered blocks by owner, until their namespace registers (one owner: the manager)."""

    def __init__(self) -> None:
        self.by_owner: dict[int, np.ndarray] = {}

    def adopt(self, blocks: np.ndarray, owners: np.ndarray, namespace: np.ndarray) -> None:
        """Blocks just recovered, with the owner each copy names."""
        theirs = owners != 0  # 0: the library's default namespace, which needs no claiming
        namespace[blocks[~theirs]] = 0
        namespace[blocks[theirs]] = UNCLAIMED_NS
        for owner in np.unique(owners[theirs]).tolist():
            self.by_owner[int(owner)] = blocks[owners == owner]

    def claim(self, owner: int, ns: int, table: BlockTable, namespace: np.ndarray) -> int:
        """Give ``owner``'s recovered blocks namespace id ``ns``; how many (ids freed meanwhile
        and reused by a block of some namespace are skipped)."""
        blocks = self.by_owner.pop(int(owner), None)
        if blocks is None:
            return 0
        mine = blocks[(table.state[blocks] == SEALED) & (namespace[blocks] == UNCLAIMED_NS)]
        namespace[mine] = ns
        return int(mine.size)

    def count(self, table: BlockTable, namespace: np.ndarray) -> int:
        """Recovered blocks still waiting for their namespace."""
        return sum(int(((table.state[b] == SEALED) & (namespace[b] == UNCLAIMED_NS)).sum())
                   for b in self.by_owner.values())

    def owners(self, blocks: np.ndarray, namespace: np.ndarray, ns_owner: np.ndarray) -> np.ndarray:
        """Each block's owner, as a clean stop's index records it: its namespace's, and an
        unclaimed block its own (written as another namespace's, it would change hands)."""
        out = ns_owner[namespace[blocks]]
        waiting = np.flatnonzero(namespace[blocks] == UNCLAIMED_NS)
        if waiting.size and self.by_owner:
            ids = np.concatenate(list(self.by_owner.values()))
            who = np.concatenate([np.full(v.size, k, dtype=np.uint64) for k, v in self.by_owner.items()])
            order = np.argsort(ids, kind="stable")
            ids, who = ids[order], who[order]
            at = np.minimum(np.searchsorted(ids, blocks[waiting]), ids.size - 1)
            found = ids[at] == blocks[waiting]
            out[waiting[found]] = who[at[found]]
        return out


__all__ = ["Unclaimed"]
