"""W-TinyLFU (Einziger, Friedman & Manes, ACM ToS '17): a window LRU, an SLRU main
cache, and TinyLFU admission between them.

New blocks enter the window (1% of the cache, an LRU). The window's LRU block
is the candidate for the main cache, an SLRU of probation (20%) and protected
(80%) segments; when the main cache is full, the candidate is admitted only
if its estimated frequency beats that of main's victim (probation's LRU
block), and whichever loses is evicted. A probation hit moves the block to
protected, whose overflow goes back to probation's MRU end.

Frequencies come from a count-min sketch of 4-bit counters (4 rows, width
the next power of two >= the cache size; every row's counter is incremented,
capped at 15) behind a doorkeeper Bloom filter that absorbs first sightings;
after 10 x cache-size additions every counter is halved and the doorkeeper
emptied (the "reset" that makes it forget old popularity). Conservative
update (``conservative=True``) and no doorkeeper are options; on the
conversation trace the default is the closest to the issue's reference
figures (see the report).
"""

from __future__ import annotations

import numpy as np

from kvtier.policy import register_policy
from kvtier.policy.base import Policy
from kvtier.tiers.intrusive import IndexLists

WINDOW, PROBATION, PROTECTED = 0, 1, 2
_SEEDS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93)
_M64 = (1 << 64) - 1


class CountMinSketch:
    """4-bit counters (capped at 15), ``depth`` rows; ``reset`` halves all of them."""

    def __init__(self, width: int, sample: int, depth: int = 4, conservative: bool = False,
                 doorkeeper: bool = False) -> None:
        self.conservative = conservative
        # doorkeeper: a Bloom filter (3 hashes, ~8 bits per sampled access) in front of the
        # counters: a first sighting sets its bits only, and counts as 1 in ``estimate``
        self.door = np.zeros(1 << max(6, int(8 * sample - 1).bit_length()), dtype=bool) if doorkeeper else None
        self.width = 1 << max(4, int(width - 1).bit_length())
        self.mask = self.width - 1
        self.table = np.zeros((depth, self.width), dtype=np.uint8)
        self.sample = int(sample)
        self.additions = 0
        self.seeds = _SEEDS[:depth]

    def _idx(self, key: int) -> list[int]:
        k = key + 1
        return [(((k * s) & _M64) >> 32) & self.mask for s in self.seeds]

    def _door_idx(self, key: int) -> list[int]:
        assert self.door is not None
        k = key + 1
        return [(((k * s) & _M64) >> 11) & (self.door.size - 1) for s in self.seeds[:3]]

    def estimate(self, key: int) -> int:
        t = self.table
        est = min(int(t[r, i]) for r, i in enumerate(self._idx(key)))
        if self.door is not None and all(self.door[i] for i in self._door_idx(key)):
            est += 1
        return est

    def add(self, key: int) -> None:
        if self.door is not None:
            di = self._door_idx(key)
            if not all(self.door[i] for i in di):
                self.door[di] = True
                self._count()
                return
        t = self.table
        idx = self._idx(key)
        vals = [int(t[r, i]) for r, i in enumerate(idx)]
        m = min(vals)
        if m < 15:
            for r, i in enumerate(idx):  # conservative update: only the counters at the minimum
                if vals[r] == m or (not self.conservative and vals[r] < 15):
                    t[r, i] = vals[r] + 1
        self._count()

    def _count(self) -> None:
        self.additions += 1
        if self.additions >= self.sample:  # reset: halve every counter, empty the doorkeeper
            self.table >>= 1
            self.additions //= 2
            if self.door is not None:
                self.door[:] = False


@register_policy("w-tinylfu")
class WTinyLFUPolicy(Policy):
    replay_only = True

    def __init__(self, capacity: int, max_blocks: int, window: float = 0.01, protected: float = 0.8,
                 sample_factor: int = 10, conservative: bool = False, doorkeeper: bool = True,
                 **_: object) -> None:
        super().__init__(capacity, max_blocks)
        self.window_cap = max(1, int(round(window * capacity))) if capacity > 1 else 0
        main = capacity - self.window_cap
        self.protected_cap = int(protected * main)
        self.q = IndexLists(max_blocks, n_lists=3)  # front = LRU end of each segment
        self.sketch = CountMinSketch(capacity, sample_factor * capacity, conservative=conservative,
                                     doorkeeper=doorkeeper)
        self.rejected = 0

    def observe(self, b: int, now: float, cls: int) -> None:
        self.sketch.add(b)

    def on_hit(self, b: int, now: float, cls: int, next_use: int) -> None:
        q = self.q
        seg = q.remove(b)
        if seg == WINDOW:
            q.push_back(b, WINDOW)
            return
        q.push_back(b, PROTECTED)
        if q.length(PROTECTED) > self.protected_cap:
            q.push_back(q.pop_front(PROTECTED), PROBATION)

    def _main_victim(self) -> int:
        q = self.q
        return q.front(PROBATION) if q.length(PROBATION) else q.front(PROTECTED)

    def evict(self, now: float) -> int:
        q = self.q
        if q.length(WINDOW) == 0 or q.length(WINDOW) < self.window_cap:
            v = self._main_victim()  # the window has room (e.g. after removals): main pays
            q.remove(v)
        else:
            cand = q.front(WINDOW)
            victim = self._main_victim()
            q.remove(cand)
            if victim >= 0 and self.sketch.estimate(cand) > self.sketch.estimate(victim):
                q.remove(victim)
                q.push_back(cand, PROBATION)
                v = victim
            else:
                self.rejected += 1
                v = cand
        self.size -= 1
        return v

    def insert(self, b: int, now: float, cls: int, next_use: int) -> None:
        q = self.q
        q.push_back(b, WINDOW)
        if q.length(WINDOW) > self.window_cap:  # the cache is not full: main takes the candidate
            q.push_back(q.pop_front(WINDOW), PROBATION)
        self.size += 1

    def remove(self, b: int) -> None:
        self.q.remove(b)
        self.size -= 1

    def stats(self) -> dict:
        return {"rejected": self.rejected}


__all__ = ["CountMinSketch", "WTinyLFUPolicy"]
