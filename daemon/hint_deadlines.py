"""Until when each hinted block is kept out of victim selection: 4 bytes a block.

A deadline is a clock reading (seconds). Held as float64 it cost 8 B a block, the
largest single column of placement. It is kept as float32 seconds past a base
instead; a base more than ``REBASE_S`` behind the clock moves forward (one
vectorised pass, every ~12 days), so a deadline is within 1/16 s of what was
asked for. Hints announce acquires seconds ahead: that is far finer than needed.
"""

from __future__ import annotations

import numpy as np

REBASE_S = float(1 << 20)  # float32 keeps 1/16 s below 2^20 s past the base


class HintDeadlines:
    """Per block: the clock reading before which it is not a victim (0: not hinted)."""

    def __init__(self, n: int, now: float) -> None:
        self.base = float(now)
        self.until = np.zeros(n, dtype=np.float32)  # seconds past ``base``; <= 0: none

    def _rel(self, t: float) -> float:
        if t - self.base >= REBASE_S:
            self._rebase(t)
        return t - self.base

    def _rebase(self, t: float) -> None:
        shift = np.float32(t - self.base - REBASE_S / 2)  # to half the span behind ``t``
        np.maximum(self.until - shift, 0.0, out=self.until)  # a deadline long passed stays passed
        self.base += float(shift)

    def extend(self, blocks: np.ndarray, until: float) -> None:
        """Protect ``blocks`` until at least ``until``."""
        rel = np.float32(self._rel(until))
        self.until[blocks] = np.maximum(self.until[blocks], rel)

    def clear(self, blocks: "np.ndarray | int") -> None:
        self.until[blocks] = 0.0

    def passed(self, blocks: "np.ndarray | int", now: float) -> "np.ndarray | bool":
        """Is ``now`` at or past each block's deadline (an unhinted block's always is)?"""
        return self.until[blocks] <= np.float32(max(now - self.base, 0.0))  # (a clock set back: 0 is passed)

    def __getitem__(self, blocks: "np.ndarray | int") -> "np.ndarray | float":
        """The deadlines as clock readings (0 where none)."""
        rel = self.until[blocks].astype(np.float64)
        return np.where(rel > 0, rel + self.base, 0.0) if isinstance(rel, np.ndarray) else \
            (float(rel) + self.base if rel > 0 else 0.0)


__all__ = ["HintDeadlines", "REBASE_S"]
