"""One engine's references and pins per block: both in one byte a block, exact at any count.

Every attached engine keeps two counts per block id: how many references it holds
(each sequence that allocated or looked the block up took one) and how many pins.
The daemon's RPC path updates them vectorised, so a dict or a hash map is too slow
(a numpy open-addressing map cost 35-65 us per 128-block acquire against 2 us), and
a ``Counter`` of references cost ~76 B for each block an engine holds (the entry,
its hash slot, the id's int object). Dense arrays cost per block *and* engine: an
int32 each was 8 B a block an engine, 128 B a block with 16 engines, half the
metadata budget. So both counts share one uint8 a block: references in the low
nibble, pins in the high one. A count of 15 or more (one engine holding one shared
prefix block from 15 sequences at once) is marked 15 in its nibble and kept exactly
in a small dict (a sorted overflow array updated in numpy was slower: its fixed cost
per call outweighs a dict update for the hundred-odd blocks of a shared prefix).
Reads and writes look like an int array's: ``pins[blocks] += 1``.
"""

from __future__ import annotations

from typing import Any, Iterator, Union

import numpy as np

BIG = 15  # a nibble's largest value: the count is in ``big``

Index = Union[int, np.integer, np.ndarray]


class PackedCounts:
    """Non-negative counts per block id in 4 bits of a shared byte array (ids or unique ids),
    with the sum and the number of blocks counted kept as they change (O(1) to read)."""

    def __init__(self, packed: np.ndarray, shift: int, count_held: bool = True) -> None:
        self.packed = packed  # shared with the other nibble's counts; owned by ``EngineCounts``
        self.shift = shift
        self.count_held = count_held  # keep ``held`` (references: an engine's live blocks)
        self.mask = np.uint8(BIG << shift)
        self.unit = np.uint8(1 << shift)
        self.big: dict[int, int] = {}  # block -> count, for counts >= BIG
        self.total = 0  # the sum of every count
        self.held = 0  # blocks whose count is not 0 (kept where ``count_held``)

    def _small(self, idx: Any) -> np.ndarray:
        return self._nibble(self.packed[idx])

    def _nibble(self, c: np.ndarray) -> np.ndarray:
        return c >> self.shift if self.shift else c & BIG  # (one numpy op: the RPC path counts them)

    def __getitem__(self, idx: Index) -> Any:
        if isinstance(idx, (int, np.integer)):
            v = (int(self.packed[idx]) >> self.shift) & BIG
            return self.big[int(idx)] if v == BIG else v
        idx = np.asarray(idx)
        out = self._small(idx).astype(np.int64)
        if self.big:
            over = out == BIG
            if over.any():
                ids = idx[over] if idx.dtype != bool else np.flatnonzero(idx)[over]
                out[over] = [self.big[int(b)] for b in ids.tolist()]
        return out

    def get(self, b: int, default: int = 0) -> int:
        return self[b]

    def __setitem__(self, idx: Index, values: Any) -> None:
        """Set counts of unique ids (or a mask); a negative count is refused before anything changes."""
        if isinstance(idx, (int, np.integer)):
            self._set_one(int(idx), int(values))
            return
        idx = np.asarray(idx)
        if idx.dtype == bool:
            idx = np.flatnonzero(idx)
        vals = np.broadcast_to(np.asarray(values, dtype=np.int64), idx.shape)
        if not vals.size:
            return
        if int(vals.min()) < 0:
            raise ValueError(f"block {int(idx[np.argmin(vals)])}: a count cannot be negative")
        old = self[idx]
        slow = (vals >= BIG) | (old >= BIG)
        if slow.any():  # counts at or past BIG (rare): one by one
            for b, v in zip(idx[slow].tolist(), vals[slow].tolist()):
                self._set_one(b, v)
            idx, vals, old = idx[~slow], vals[~slow], old[~slow]
        self._count(old, vals)
        self.packed[idx] = (self.packed[idx] & ~self.mask) | (vals.astype(np.uint8) << self.shift)

    def _count(self, old: np.ndarray, new: np.ndarray) -> None:
        self.total += int(new.sum() - old.sum())
        if self.count_held:
            self.held += int(np.count_nonzero(new)) - int(np.count_nonzero(old))

    def add(self, blocks: np.ndarray) -> None:
        """One more on each of ``blocks`` (unique ids): the RPC path's update, four to six
        numpy calls; a block at or past the limit (many sequences sharing one prefix)
        costs a dict update more, not a per-block call."""
        c = self.packed[blocks]
        if not c.size:
            return
        # the high nibble is compared as the byte itself: one numpy call fewer
        n = None if self.shift else c & BIG
        near = int(c.max()) >= (BIG - 1) << 4 if n is None else int(n.max()) >= BIG - 1
        if self.count_held:
            n = self._nibble(c) if n is None else n
            self.held += int(c.size - np.count_nonzero(n))
        if near:
            n = self._nibble(c) if n is None else n
            over = n >= BIG - 1  # 14 becomes 15 (into the dict) or 15 (in the dict) grows
            big = self.big
            for b in blocks[over].tolist():
                big[b] = big.get(b, BIG - 1) + 1
            c[over] |= self.mask
            c[~over] += self.unit
        else:
            c += self.unit
        self.total += int(c.size)
        self.packed[blocks] = c

    def add_many(self, blocks: np.ndarray) -> None:
        """One more per occurrence in ``blocks`` (ids may repeat: keys looked up twice)."""
        if blocks.size > 1:
            if blocks.size <= 64:  # a set of a few ids is quicker than a sort
                repeats = len(set(blocks.tolist())) < blocks.size
            else:
                s = np.sort(blocks)
                repeats = not (s[1:] != s[:-1]).all()
            if repeats:
                u, k = np.unique(blocks, return_counts=True)
                self[u] = self[u] + k
                return
        self.add(blocks)

    def sub(self, blocks: np.ndarray) -> None:
        """One fewer on each of ``blocks`` (unique ids); a block counted 0 is refused
        (ValueError) before anything changes."""
        c = self.packed[blocks]
        if not c.size:
            return
        n = None if self.shift else c & BIG
        lo, hi = (int(c.min()) >> 4, int(c.max()) >> 4) if n is None else (int(n.min()), int(n.max()))
        if lo == 0:
            n = self._nibble(c) if n is None else n
            raise ValueError(f"block {int(blocks[np.argmin(n)])}: a count cannot be negative")
        if self.count_held:
            n = self._nibble(c) if n is None else n
            self.held -= int(np.count_nonzero(n == 1))
        if hi == BIG:  # counts in the dict: one fewer there; back in the nibble at 14
            n = self._nibble(c) if n is None else n
            over = n == BIG
            big, ids = self.big, blocks[over].tolist()
            left = np.empty(len(ids), dtype=np.uint8)
            for i, b in enumerate(ids):
                v = big[b] - 1
                if v >= BIG:
                    big[b] = v
                    left[i] = BIG
                else:
                    del big[b]
                    left[i] = v
            c[over] = (c[over] & ~self.mask) | (left << self.shift)
            c[~over] -= self.unit
        else:
            c -= self.unit
        self.total -= int(c.size)
        self.packed[blocks] = c

    def _set_one(self, b: int, v: int) -> None:
        if v < 0:
            raise ValueError(f"block {b}: a count cannot be negative ({v})")
        old = self[b]
        self.total += v - old
        if self.count_held:
            self.held += (v > 0) - (old > 0)
        if v >= BIG:
            self.big[b] = v
        else:
            self.big.pop(b, None)
        small = min(v, BIG)
        self.packed[b] = (int(self.packed[b]) & ~int(self.mask) & 0xFF) | (small << self.shift)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """Every count, as int64 (O(blocks): invariant checks and engine teardown only)."""
        out = self._small(slice(None)).astype(np.int64)
        for b, v in self.big.items():
            out[b] = v
        return out if dtype is None else out.astype(dtype)

    def pinned(self, blocks: np.ndarray) -> np.ndarray:
        """Per block of ``blocks``: is its count above 0 (one gather, no counts built)?"""
        return (self.packed[blocks] & self.mask) != 0

    def nonzero_ids(self) -> np.ndarray:
        """Block ids counted above 0 (O(blocks))."""
        return np.flatnonzero(self.packed & self.mask)

    def items(self) -> Iterator[tuple[int, int]]:
        """(block, count) of every block counted above 0 (O(blocks): teardown only)."""
        ids = self.nonzero_ids()
        return zip(ids.tolist(), self[ids].tolist())

    def sum(self) -> int:
        return self.total

    def __bool__(self) -> bool:
        return self.held > 0 if self.count_held else self.total > 0


class EngineCounts:
    """One engine's references (low nibble) and pins (high nibble) in one byte a block."""

    def __init__(self, n: int) -> None:
        self.packed = np.zeros(n, dtype=np.uint8)
        self.refs = PackedCounts(self.packed, 0)
        self.pins = PackedCounts(self.packed, 4, count_held=False)  # their sum is all that is read


__all__ = ["EngineCounts", "PackedCounts", "BIG"]
