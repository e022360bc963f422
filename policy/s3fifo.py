"""S3-FIFO (Yang et al., SOSP'23): small FIFO, main FIFO, ghost FIFO.

10% small queue, frequency capped at 3, promotion to main at frequency >= 1,
ghost of main's size; the configuration of the reference figures.
"""

from __future__ import annotations

import numpy as np

from kvtier.policy import register_policy
from kvtier.policy.base import Policy
from kvtier.tiers.intrusive import IndexLists

SMALL, MAIN, GHOST = 0, 1, 2


@register_policy("s3fifo")
class S3FIFOPolicy(Policy):
    def __init__(self, capacity: int, max_blocks: int, small_fraction: float = 0.1,
                 max_freq: int = 3, move_threshold: int = 1, **_: object) -> None:
        super().__init__(capacity, max_blocks)
        self.q = IndexLists(max_blocks, n_lists=3)
        self.freq = np.zeros(max_blocks, dtype=np.uint8)
        self.small_cap = max(1, int(round(small_fraction * capacity)))
        self.ghost_cap = max(1, capacity - self.small_cap)
        self.max_freq = max_freq
        self.move_threshold = move_threshold

    def on_hit(self, b: int, now: float, cls: int, next_use: int) -> None:
        if self.freq[b] < self.max_freq:
            self.freq[b] += 1

    def insert(self, b: int, now: float, cls: int, next_use: int) -> None:
        q = self.q
        if q.owner[b] == GHOST:
            q.remove(b)
            q.push_back(b, MAIN)
        else:
            q.push_back(b, SMALL)
        self.freq[b] = 0
        self.size += 1

    def evict(self, now: float) -> int:
        q = self.q
        while True:
            if q.length(SMALL) >= self.small_cap or q.length(MAIN) == 0:
                t = q.pop_front(SMALL)
                if self.freq[t] >= self.move_threshold:
                    self.freq[t] = 0
                    q.push_back(t, MAIN)
                    continue
                if q.length(GHOST) >= self.ghost_cap:
                    q.pop_front(GHOST)
                q.push_back(t, GHOST)
                self.size -= 1
                return t
            t = q.pop_front(MAIN)
            if self.freq[t] > 0:
                self.freq[t] -= 1
                q.push_back(t, MAIN)
                continue
            self.size -= 1
            return t

    def remove(self, b: int) -> None:
        self.q.remove(b)
        self.size -= 1
