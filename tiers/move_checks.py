"""Why a move is refused, and where a promotion reads from: the checks ``TierMoves`` runs
off its common path (each mask is a pass over the blocks, so the planner tests the cheap
summary first and comes here only for the reason)."""

from __future__ import annotations

import numpy as np

from .block_table import BlockTable
from .types import Tier


def _promote_sources() -> np.ndarray:
    """[dst tier][copies bits] -> the tier a promotion into dst reads from (the fastest
    below dst holding a copy), -2 if dst holds one already, -1 if none below does."""
    out = np.full((len(Tier), 256), -1, dtype=np.int8)
    for dst in Tier:
        for bits in range(256):
            below = [t for t in Tier if t > dst and (bits >> t) & 1]
            out[dst, bits] = -2 if (bits >> dst) & 1 else below[0] if below else -1
    return out


PROMOTE_SOURCE = _promote_sources()


def _refuse(arr: np.ndarray, masks: tuple[np.ndarray, ...], src: Tier) -> None:
    """Raise the first of ``_move``'s refusal reasons, in order, for the first block it names."""
    reasons = (f"has no valid copy in {src.name}", "is already moving", "is pinned",
               "is being read by a remote write; its copies stay")
    mask, why = next((m, r) for m, r in zip(masks, reasons) if m.any())
    raise ValueError(f"block {int(arr[np.argmax(mask)])} {why}")


def refuse_move(t: BlockTable, arr: np.ndarray, copies: np.ndarray, keep: np.ndarray, src: Tier) -> None:
    """Raise for the first block of ``arr`` a move may not take, if one is: no copy in ``src``,
    moving, or, where its source copy would go (``~keep``: an open block's always goes),
    pinned or read by a remote write (a pin or a read hold alone is no refusal where it stays)."""
    readers = t.readers[arr]
    masks = ((copies >> int(src)) & 1 == 0, t.busy[arr] != readers, (t.pins[arr] != 0) & ~keep,
             (readers != 0) & ~keep)
    if (masks[0] | masks[1] | masks[2] | masks[3]).any():
        _refuse(arr, masks, src)


__all__ = ["PROMOTE_SOURCE", "refuse_move"]
