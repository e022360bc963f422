"""One engine's pins per block: 1 byte a block, exact at any count.

Every attached engine keeps a count per block id (the daemon's RPC path updates
them vectorised, so a dict or a hash map is too slow: a numpy open-addressing map
cost 35-65 us per 128-block acquire against 2 us). A dense int32 array cost 4 B a
block an engine: 64 B a block with 16 engines, a quarter of the metadata budget.
Counts live in a uint8 array instead; a count of 255 or more (one engine pinning
one block from 255 sequences at once) is marked 255 there and kept exactly in a
small dict. Reads and writes look like the array's: ``pins[blocks] += 1`` works.
"""

from __future__ import annotations

from typing import Any, Union

import numpy as np

BIG = 255  # in ``small``: the count is in ``big``

Index = Union[int, np.integer, np.ndarray]


class PinCounts:
    """Non-negative counts per block id, indexed like a numpy array (ints or unique ids)."""

    def __init__(self, n: int) -> None:
        self.small = np.zeros(n, dtype=np.uint8)
        self.big: dict[int, int] = {}  # block -> count, for counts >= BIG

    def __len__(self) -> int:
        return int(self.small.size)

    def __getitem__(self, idx: Index) -> Any:
        if isinstance(idx, (int, np.integer)):
            v = int(self.small[idx])
            return self.big[int(idx)] if v == BIG else v
        idx = np.asarray(idx)
        out = self.small[idx].astype(np.int64)
        if self.big:
            over = out == BIG
            if over.any():
                ids = idx[over] if idx.dtype != bool else np.flatnonzero(idx)[over]
                out[over] = [self.big[int(b)] for b in ids.tolist()]
        return out

    def __setitem__(self, idx: Index, values: Any) -> None:
        if isinstance(idx, (int, np.integer)):
            self._set_one(int(idx), int(values))
            return
        idx = np.asarray(idx)
        if idx.dtype == bool:
            idx = np.flatnonzero(idx)
        vals = np.broadcast_to(np.asarray(values, dtype=np.int64), idx.shape)
        if vals.size:
            if int(vals.min()) < 0:  # refused before anything changes
                raise ValueError(f"block {int(idx[np.argmin(vals)])}: a pin count cannot be negative")
            slow = vals >= BIG
            if self.big:
                slow |= self.small[idx] == BIG
            if slow.any():  # counts at or past BIG (rare): one by one
                self.small[idx[~slow]] = vals[~slow]
                for b, v in zip(idx[slow].tolist(), vals[slow].tolist()):
                    self._set_one(b, v)
                return
        self.small[idx] = vals

    def add(self, blocks: np.ndarray) -> None:
        """One more pin on each of ``blocks`` (unique ids): the RPC path's update, four
        numpy calls while no count nears the limit (indexing with ``+=`` takes ~4x that)."""
        if not self.big:
            c = self.small[blocks]
            c += 1
            if not c.size or int(c.max()) < BIG:
                self.small[blocks] = c
                return
        self[blocks] = self[blocks] + 1

    def sub(self, blocks: np.ndarray) -> None:
        """One pin fewer on each of ``blocks`` (unique ids); a block without a pin is
        refused (ValueError) before anything changes."""
        c = self.small[blocks]
        if c.size and int(c.min()) == 0:
            raise ValueError(f"block {int(blocks[np.argmin(c)])}: a pin count cannot be negative")
        if self.big and bool((c == BIG).any()):
            self[blocks] = self[blocks] - 1
            return
        c -= 1
        self.small[blocks] = c

    def _set_one(self, b: int, v: int) -> None:
        if v < 0:
            raise ValueError(f"block {b}: a pin count cannot be negative ({v})")
        if v >= BIG:
            self.big[b] = v
            self.small[b] = BIG
        else:
            self.big.pop(b, None)
            self.small[b] = v

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """Every count, as int64 (O(blocks): invariant checks and engine teardown only)."""
        out = self.small.astype(np.int64)
        for b, v in self.big.items():
            out[b] = v
        return out if dtype is None else out.astype(dtype)

    def pinned(self, blocks: np.ndarray) -> np.ndarray:
        """Per block of ``blocks``: does this engine pin it (one gather, no counts built)?"""
        return self.small[blocks] != 0

    def nonzero_ids(self) -> np.ndarray:
        """Block ids this engine pins (O(blocks))."""
        return np.flatnonzero(self.small)

    def sum(self) -> int:
        return int(self.small.sum(dtype=np.int64)) + sum(v - BIG for v in self.big.values())


__all__ = ["PinCounts", "BIG"]
