"""GDSF (Cherkasova, HP Labs TR '98): Greedy-Dual-Size with Frequency.

Each resident block has priority H = L + freq x cost / size, where freq counts
its accesses since it entered the cache and L, the inflation ("aging") value,
becomes the priority of each evicted block. The block of least H goes; a
block's H is recomputed from the current L at every hit, so blocks that
stopped being read fall behind newer ones as L rises.

In replay every block has the same size and cost 1, so H = L + freq: this is
LFU with dynamic aging (LFU-DA). Ties go to the block whose priority was set
longest ago. A heap with lazy invalidation gives O(log n) per access.
"""

from __future__ import annotations

import heapq

import numpy as np

from kvtier.policy import register_policy
from kvtier.policy.base import Policy


@register_policy("gdsf")
class GDSFPolicy(Policy):
    replay_only = True

    def __init__(self, capacity: int, max_blocks: int, **_: object) -> None:
        super().__init__(capacity, max_blocks)
        self.freq = np.zeros(max_blocks, dtype=np.int64)
        self.prio = np.full(max_blocks, -1.0)  # -1: not resident
        self.stamp = np.zeros(max_blocks, dtype=np.int64)  # when the priority was set (tie-break)
        self.heap: list[tuple[float, int, int]] = []  # (H, stamp, block), lazily invalidated
        self.L = 0.0
        self._t = 0

    def _set(self, b: int) -> None:
        h = self.L + float(self.freq[b])
        self._t += 1
        self.prio[b] = h
        self.stamp[b] = self._t
        heapq.heappush(self.heap, (h, self._t, b))
        if len(self.heap) > 4 * self.capacity + 64:  # drop stale entries: amortised O(log n)
            self.heap = [e for e in self.heap if self.stamp[e[2]] == e[1] and self.prio[e[2]] >= 0]
            heapq.heapify(self.heap)

    def on_hit(self, b: int, now: float, cls: int, next_use: int) -> None:
        self.freq[b] += 1
        self._set(b)

    def insert(self, b: int, now: float, cls: int, next_use: int) -> None:
        self.freq[b] = 1
        self._set(b)
        self.size += 1

    def evict(self, now: float) -> int:
        heap, stamp, prio = self.heap, self.stamp, self.prio
        while True:
            h, t, b = heapq.heappop(heap)
            if stamp[b] == t and prio[b] >= 0:
                break
        self.L = h
        self.prio[b] = -1.0
        self.freq[b] = 0
        self.size -= 1
        return b

    def remove(self, b: int) -> None:
        self.prio[b] = -1.0
        self.freq[b] = 0
        self.size -= 1

    def on_freed(self, b: int) -> None:
        self.freq[b] = 0

    def stats(self) -> dict:
        return {"L": self.L}


__all__ = ["GDSFPolicy"]
