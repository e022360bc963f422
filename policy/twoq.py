"""2Q (Johnson & Shasha, VLDB '94, the full version): A1in FIFO, A1out ghosts, Am LRU.

A block seen for the first time enters A1in, a FIFO of resident blocks; a hit
there changes nothing (correlated references are not evidence of reuse).
When A1in holds more than Kin blocks, its oldest is evicted and its id goes
to A1out, a FIFO of at most Kout ids; a miss on a block whose id is in A1out
proves a reuse at a distance and brings it into Am, an LRU. Otherwise Am's
LRU block is evicted, with no ghost. Kin = 25% and Kout = 50% of the cache,
the paper's recommended setting.
"""

from __future__ import annotations

from kvtier.policy import register_policy
from kvtier.policy.base import Policy
from kvtier.tiers.intrusive import IndexLists

A1IN, AM, A1OUT = 0, 1, 2


@register_policy("2q")
class TwoQPolicy(Policy):
    replay_only = True

    def __init__(self, capacity: int, max_blocks: int, kin: float = 0.25, kout: float = 0.5,
                 **_: object) -> None:
        super().__init__(capacity, max_blocks)
        self.q = IndexLists(max_blocks, n_lists=3)  # front = oldest / LRU
        self.kin = max(1, int(kin * capacity))
        self.kout = max(1, int(kout * capacity))
        self._remembered = -1  # the requested block, if A1out held its id when it was requested

    def observe(self, b: int, now: float, cls: int) -> None:
        # decided at the request: making room may push this very id out of A1out
        self._remembered = b if self.q.list_of(b) == A1OUT else -1

    def on_hit(self, b: int, now: float, cls: int, next_use: int) -> None:
        if self.q.list_of(b) == AM:
            self.q.remove(b)
            self.q.push_back(b, AM)

    def evict(self, now: float) -> int:
        q = self.q
        if q.length(A1IN) > self.kin or q.length(AM) == 0:
            v = q.pop_front(A1IN)
            q.push_back(v, A1OUT)
            if q.length(A1OUT) > self.kout:
                q.pop_front(A1OUT)
        else:
            v = q.pop_front(AM)  # not remembered: it has not been read for a while
        self.size -= 1
        return v

    def insert(self, b: int, now: float, cls: int, next_use: int) -> None:
        q = self.q
        if b == self._remembered or q.list_of(b) == A1OUT:
            q.discard(b)
            q.push_back(b, AM)
        else:
            q.push_back(b, A1IN)
        self.size += 1

    def remove(self, b: int) -> None:
        self.q.remove(b)
        self.size -= 1

    def on_freed(self, b: int) -> None:
        if self.q.list_of(b) == A1OUT:
            self.q.remove(b)


__all__ = ["TwoQPolicy"]
