"""Belady's MIN: evict the block whose next use is farthest (offline oracle).

Only the replay simulator can run it: it needs each access's next-use index.
``belady`` admits every miss (the reference "no bypass" figure);
``belady-bypass`` also declines a missed block whose next use is farther
than every resident block's.
"""

from __future__ import annotations

import heapq

import numpy as np

from kvtier.policy import register_policy
from kvtier.policy.base import Policy


@register_policy("belady")
class BeladyPolicy(Policy):
    offline = True
    bypass = False

    def __init__(self, capacity: int, max_blocks: int, **_: object) -> None:
        super().__init__(capacity, max_blocks)
        self.next_use = np.full(max_blocks, -1, dtype=np.int64)
        self.heap: list[tuple[int, int]] = []  # (-next_use, block), lazily invalidated

    def _set(self, b: int, next_use: int) -> None:
        self.next_use[b] = next_use
        heapq.heappush(self.heap, (-next_use, b))

    def _top(self) -> int:
        heap, nu = self.heap, self.next_use
        while True:
            neg, b = heap[0]
            if nu[b] == -neg:
                return b
            heapq.heappop(heap)

    def on_hit(self, b: int, now: float, cls: int, next_use: int) -> None:
        self._set(b, next_use)

    def admit(self, b: int, now: float, cls: int, next_use: int) -> bool:
        if not self.bypass or self.size < self.capacity:
            return True
        return next_use < self.next_use[self._top()]

    def evict(self, now: float) -> int:
        b = self._top()
        heapq.heappop(self.heap)
        self.next_use[b] = -1
        self.size -= 1
        return b

    def insert(self, b: int, now: float, cls: int, next_use: int) -> None:
        self._set(b, next_use)
        self.size += 1

    def remove(self, b: int) -> None:
        self.next_use[b] = -1
        self.size -= 1


@register_policy("belady-bypass")
class BeladyBypassPolicy(BeladyPolicy):
    bypass = True
