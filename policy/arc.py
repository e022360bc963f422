"""ARC (Megiddo & Modha, FAST '03): recency and frequency lists with a self-tuned split.

T1 holds blocks seen once recently, T2 blocks seen at least twice; B1 and B2
are their ghosts (ids only, no data), so the directory tracks at most 2c
blocks. A hit in B1 says T1 was too small: the target size ``p`` of T1 grows
by max(|B2|/|B1|, 1); a hit in B2 shrinks it by max(|B1|/|B2|, 1). REPLACE
evicts T1's LRU block into B1 when |T1| > p (or |T1| = p and the request is a
B2 ghost), else T2's LRU block into B2. On a miss of a block in no list
(case IV): if |T1| + |B1| = c, B1's LRU ghost goes (or, when B1 is empty,
T1's LRU block is evicted with no ghost); otherwise, when the directory holds
2c blocks, B2's LRU ghost goes.

The mechanism calls ``observe`` for the requested block first (which finds
its case and adapts ``p``), then ``evict`` when the cache is full, then
``insert``: the same order as the paper's four cases.
"""

from __future__ import annotations

from kvtier.policy import register_policy
from kvtier.policy.base import Policy
from kvtier.tiers.intrusive import IndexLists

T1, T2, B1, B2 = 0, 1, 2, 3


@register_policy("arc")
class ARCPolicy(Policy):
    replay_only = True

    def __init__(self, capacity: int, max_blocks: int, int_delta: bool = True, **_: object) -> None:
        super().__init__(capacity, max_blocks)
        self.int_delta = int_delta
        self.lists = IndexLists(max_blocks, n_lists=4)  # front = LRU end
        self.p = 0.0
        self._case = -1  # list of the block being requested (-1: in none), set by observe

    def _len(self, lst: int) -> int:
        return int(self.lists.lengths[lst])

    def observe(self, b: int, now: float, cls: int) -> None:
        where = self.lists.list_of(b)
        self._case = where
        if where == B1:
            d = self._len(B2) // self._len(B1) if self.int_delta else self._len(B2) / self._len(B1)
            self.p = min(self.p + max(d, 1.0), float(self.capacity))
        elif where == B2:
            d = self._len(B1) // self._len(B2) if self.int_delta else self._len(B1) / self._len(B2)
            self.p = max(self.p - max(d, 1.0), 0.0)

    def on_hit(self, b: int, now: float, cls: int, next_use: int) -> None:
        self.lists.remove(b)
        self.lists.push_back(b, T2)

    def _replace(self, in_b2: bool) -> int:
        q = self.lists
        t1 = self._len(T1)
        if t1 >= 1 and ((in_b2 and t1 == self.p) or t1 > self.p or self._len(T2) == 0):
            v = q.pop_front(T1)
            q.push_back(v, B1)
        else:
            v = q.pop_front(T2)
            q.push_back(v, B2)
        self.size -= 1
        return v

    def evict(self, now: float) -> int:
        q, c = self.lists, self.capacity
        if self._case in (B1, B2):
            return self._replace(self._case == B2)
        if self._len(T1) + self._len(B1) >= c:  # case IV.A
            if self._len(T1) < c:
                q.pop_front(B1)
                return self._replace(False)
            self.size -= 1
            return q.pop_front(T1)  # B1 is empty: T1's LRU block leaves without a ghost
        if self._len(T1) + self._len(T2) + self._len(B1) + self._len(B2) >= 2 * c:  # case IV.B
            q.pop_front(B2)
        return self._replace(False)

    def insert(self, b: int, now: float, cls: int, next_use: int) -> None:
        q, c = self.lists, self.capacity
        where = q.list_of(b)
        if where in (B1, B2):
            q.remove(b)
            q.push_back(b, T2)
        else:
            q.push_back(b, T1)
        self.size += 1
        self._case = -1
        # the directory bounds (|T1|+|B1| <= c, all <= 2c) hold by construction in replay;
        # a mechanism that drops residents directly could break them, so they are enforced
        if self._len(T1) + self._len(B1) > c and self._len(B1):
            q.pop_front(B1)
        if int(q.lengths.sum()) > 2 * c:
            q.pop_front(B2 if self._len(B2) else B1)

    def remove(self, b: int) -> None:
        self.lists.remove(b)
        self.size -= 1

    def on_freed(self, b: int) -> None:
        if self.lists.list_of(b) in (B1, B2):  # a ghost of a block that no longer exists
            self.lists.remove(b)

    def stats(self) -> dict:
        return {"p": self.p, "ghosts": self._len(B1) + self._len(B2)}


__all__ = ["ARCPolicy"]
