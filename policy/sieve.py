"""SIEVE (Zhang et al., NSDI '24): one FIFO queue, a visited bit, a moving hand.

A hit only sets the block's visited bit (no list move: lazy promotion). New
blocks enter at the head. To evict, the hand walks from where it stopped
towards the head (starting at the tail, the oldest, and wrapping back to it),
clearing visited bits, and evicts the first unvisited block; it then rests on
that block's newer neighbour. Survivors stay in place, so new blocks (quick
demotion) are examined before old visited ones come round again.

Here the list front is the tail (oldest) and the back the head (newest): the
hand moves front to back along ``next``.
"""

from __future__ import annotations

import numpy as np

from kvtier.policy import register_policy
from kvtier.policy.base import Policy
from kvtier.tiers.intrusive import NIL, IndexLists


@register_policy("sieve")
class SievePolicy(Policy):
    replay_only = True

    def __init__(self, capacity: int, max_blocks: int, **_: object) -> None:
        super().__init__(capacity, max_blocks)
        self.q = IndexLists(max_blocks)
        self.visited = np.zeros(max_blocks, dtype=bool)
        self.hand = NIL

    def on_hit(self, b: int, now: float, cls: int, next_use: int) -> None:
        self.visited[b] = True

    def insert(self, b: int, now: float, cls: int, next_use: int) -> None:
        self.q.push_back(b)
        self.visited[b] = False
        self.size += 1

    def _step(self, e: int) -> int:
        """The hand's next position after ``e``: its newer neighbour, or the tail at the head."""
        e = int(self.q.next[e])
        return int(self.q.next[e]) if e == self.q.sentinel(0) else e

    def evict(self, now: float) -> int:
        o = self.hand if self.hand != NIL else self.q.front()
        vis = self.visited
        while vis[o]:
            vis[o] = False
            o = self._step(o)
        self.hand = o  # the hand rests on the victim's newer neighbour (remove moves it there)
        self.remove(o)
        return o

    def remove(self, b: int) -> None:
        if self.hand == b:
            nxt = int(self.q.next[b])
            self.hand = NIL if nxt == self.q.sentinel(0) else nxt
        self.q.remove(b)
        self.size -= 1

    def on_freed(self, b: int) -> None:
        self.visited[b] = False


__all__ = ["SievePolicy"]
