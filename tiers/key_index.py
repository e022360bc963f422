"""Key -> block index map as a numpy open-addressing hash table.

A Python dict costs ~100 B per entry for 64-bit keys (boxed ints); this table
costs 12 B per slot at load factor <= 1/2, i.e. 24 B per tracked block, and
supports vectorised batch lookups. Linear probing with tombstones; the table
never resizes because the block table is preallocated.
"""

from __future__ import annotations

import numpy as np

_EMPTY = -1
_TOMB = -2
_MUL = 0x9E3779B97F4A7C15
_M64 = (1 << 64) - 1


def all_distinct(a: np.ndarray) -> bool:
    """No value twice. A sort and a neighbour compare: numpy 2's hash-based ``np.unique``
    took 1.9 s for 10^6 keys where this takes 0.1 s (a restart adopts 10^7)."""
    if a.size < 2:
        return True
    a = a.reshape(-1)
    if bool((a[1:] > a[:-1]).all()):  # already increasing (slot and block ranges): no sort needed
        return True
    s = np.sort(a)
    return not bool((s[1:] == s[:-1]).any())


class KeyIndex:
    def __init__(self, max_entries: int) -> None:
        cap = 8
        while cap < 2 * max(1, max_entries):
            cap <<= 1
        self.capacity = cap
        self.mask = cap - 1
        self.shift = 64 - cap.bit_length() + 1
        self.keys = np.zeros(cap, dtype=np.uint64)
        self.vals = np.full(cap, _EMPTY, dtype=np.int32)
        self.size = 0
        self.max_entries = int(max_entries)

    def _home(self, key: int) -> int:
        return ((key * _MUL) & _M64) >> self.shift

    def _find(self, key: int) -> int:
        """Table position holding ``key`` (already masked to 64 bits), or -1."""
        i = self._home(key)
        keys, vals, mask = self.keys, self.vals, self.mask
        while True:
            v = int(vals[i])
            if v == _EMPTY:
                return -1
            if v >= 0 and int(keys[i]) == key:
                return i
            i = (i + 1) & mask

    def get(self, key: int, default: int = -1) -> int:
        i = self._find(int(key) & _M64)
        return default if i < 0 else int(self.vals[i])

    def __contains__(self, key: int) -> bool:
        return self.get(key) >= 0

    def __len__(self) -> int:
        return self.size

    def insert(self, key: int, value: int) -> None:
        """Insert a new key; ValueError if present or full."""
        if value < 0:
            raise ValueError("value must be >= 0")
        key = int(key) & _M64
        i = self._home(key)
        first_free = -1
        keys, vals, mask = self.keys, self.vals, self.mask
        while True:
            v = int(vals[i])
            if v == _EMPTY:
                break
            if v == _TOMB:
                if first_free < 0:
                    first_free = i
            elif int(keys[i]) == key:
                raise ValueError(f"key {key:#x} already indexed (block {v})")
            i = (i + 1) & mask
        if self.size >= self.max_entries:
            raise ValueError("key index is full")
        slot = first_free if first_free >= 0 else i
        keys[slot] = key
        vals[slot] = value
        self.size += 1

    def insert_many(self, keys_in: np.ndarray, values: np.ndarray, checked: bool = False) -> None:
        """Insert new keys in one vectorised pass (a restart adopts millions at once: a
        Python insert per key took ~5 s per 10^6). All or nothing: ValueError, with no
        change, if a key repeats, is present already, or the table would overflow
        (``checked``: the caller has just verified the keys are distinct and absent)."""
        q = np.asarray(keys_in, dtype=np.uint64).reshape(-1)
        vals = np.asarray(values, dtype=np.int64).reshape(-1)
        if q.size != vals.size:
            raise ValueError(f"{q.size} keys but {vals.size} values")
        if q.size == 0:
            return
        if (vals < 0).any():
            raise ValueError("values must be >= 0")
        if self.size + q.size > self.max_entries:
            raise ValueError("key index is full")
        if not checked and (not all_distinct(q) or (self.get_many(q) >= 0).any()):
            raise ValueError("a key to insert is repeated or already indexed")
        with np.errstate(over="ignore"):
            pos = ((q * np.uint64(_MUL)) >> np.uint64(self.shift)).astype(np.int64)
        todo = np.arange(q.size)
        while todo.size:  # each round: every key still looking claims its free position, one per position wins
            free = np.flatnonzero(self.vals[pos[todo]] < 0)  # empty or a tombstone (the keys are absent)
            cand = todo[free]
            self.vals[pos[cand]] = cand  # claims: of keys sharing a position, one write stays
            mine = self.vals[pos[cand]] == cand
            won = cand[mine]
            self.keys[pos[won]] = q[won]
            self.vals[pos[won]] = vals[won]  # every claimed position has a winner: no claim is left behind
            keep = np.ones(todo.size, dtype=bool)
            keep[free[mine]] = False
            todo = todo[keep]
            pos[todo] = (pos[todo] + 1) & self.mask
        self.size += q.size

    def pop(self, key: int) -> int:
        """Remove ``key``; returns its value, or -1 if absent."""
        i = self._find(int(key) & _M64)
        if i < 0:
            return -1
        vals, mask = self.vals, self.mask
        v = int(vals[i])
        vals[i] = _TOMB
        self.size -= 1
        # a tombstone followed by EMPTY can become EMPTY: keeps probe
        # chains short under churn without rehashing.
        j = i
        while int(vals[(j + 1) & mask]) == _EMPTY and int(vals[j]) == _TOMB:
            vals[j] = _EMPTY
            j = (j - 1) & mask
        return v

    def get_many(self, keys_in: np.ndarray) -> np.ndarray:
        """Vectorised lookup: block index per key, -1 where absent."""
        q = np.asarray(keys_in, dtype=np.uint64)
        out = np.full(q.shape, -1, dtype=np.int64)
        with np.errstate(over="ignore"):
            pos = ((q * np.uint64(_MUL)) >> np.uint64(self.shift)).astype(np.int64)
        todo = np.arange(q.size)
        for _ in range(self.capacity):
            if todo.size == 0:
                break
            v = self.vals[pos[todo]]
            hit = (v >= 0) & (self.keys[pos[todo]] == q[todo])
            out[todo[hit]] = v[hit]
            cont = ~hit & (v != _EMPTY)
            todo = todo[cont]
            pos[todo] = (pos[todo] + 1) & self.mask
        return out

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        live = self.vals >= 0
        return self.keys[live].copy(), self.vals[live].astype(np.int64)

    def nbytes(self) -> int:
        return self.keys.nbytes + self.vals.nbytes
