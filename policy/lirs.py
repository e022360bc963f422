"""LIRS (Jiang & Zhang, SIGMETRICS '02): rank blocks by inter-reference recency.

Blocks whose last two accesses were close (LIR) keep 99% of the cache; the
other 1% holds HIR blocks, resident on probation in the FIFO queue Q. The
stack S orders blocks by recency: LIR blocks, resident HIR blocks and
non-resident HIR blocks (ids only). Its bottom is always an LIR block
("stack pruning" removes HIR entries below the oldest LIR one). A hit on an
HIR block still in S, or a miss on a non-resident one, proves a reuse
distance shorter than the oldest LIR block's recency: it becomes LIR and the
bottom LIR block is demoted to the tail of Q. Misses evict Q's head. Until the
LIR set is full every accessed block becomes LIR (warm-up). Each part has at least one
slot (one HIR slot even where 1% rounds to 0); a one-block cache has just its LIR slot, so
every miss evicts it, as LRU.

Non-resident HIR ids are bounded (``nonresident`` x the cache size; the
paper bounds S to keep memory finite): past the bound the oldest of them
(lowest recency stamp, found by a lazily invalidated heap) leaves S.
"""

from __future__ import annotations

import heapq

import numpy as np

from kvtier.policy import register_policy
from kvtier.policy.base import Policy
from kvtier.tiers.intrusive import IndexLists

NONE, LIR, HIR, NR = 0, 1, 2, 3


@register_policy("lirs")
class LIRSPolicy(Policy):
    replay_only = True

    def __init__(self, capacity: int, max_blocks: int, hir_fraction: float = 0.01, nonresident: float = 10.0,
                 **_: object) -> None:
        super().__init__(capacity, max_blocks)
        # at least one LIR slot (a promotion demotes the bottom LIR block, so with none the
        # bottom of S is no LIR block) and, from 2 blocks on, at least one HIR slot; one block
        # is a single LIR slot: each miss evicts it, as LRU (any policy without bypass does so)
        self.l_hirs = min(max(1, int(round(hir_fraction * capacity))), capacity - 1)
        self.l_lirs = capacity - self.l_hirs
        self.nr_max = max(1, int(nonresident * capacity))
        self.S = IndexLists(max_blocks)  # front = bottom (least recent)
        self.Q = IndexLists(max_blocks)  # front = next HIR victim
        self.state = np.zeros(max_blocks, dtype=np.int8)
        self.stamp = np.zeros(max_blocks, dtype=np.int64)
        self.n_lir = 0
        self.n_nr = 0
        self._seq = 0
        self._nr_heap: list[tuple[int, int]] = []  # (stamp, block) of non-resident HIR entries

    def _in_s(self, b: int) -> bool:
        return int(self.S.owner[b]) == 0

    def _to_top(self, b: int) -> None:
        if self._in_s(b):
            self.S.remove(b)
        self.S.push_back(b)
        self._seq += 1
        self.stamp[b] = self._seq

    def _prune(self) -> None:
        S, state = self.S, self.state
        while S.length() and state[S.front()] != LIR:
            b = S.pop_front()
            if state[b] == NR:
                state[b] = NONE
                self.n_nr -= 1

    def _demote_bottom(self) -> None:
        b = self.S.pop_front()
        self.state[b] = HIR
        self.Q.push_back(b)
        self.n_lir -= 1
        self._prune()

    def _bound_nonresident(self) -> None:
        heap, state, stamp = self._nr_heap, self.state, self.stamp
        while self.n_nr > self.nr_max:
            st, b = heapq.heappop(heap)
            if state[b] == NR and stamp[b] == st:
                self.S.remove(b)
                state[b] = NONE
                self.n_nr -= 1
        if len(heap) > 2 * self.nr_max + 64:  # compaction: amortised O(log n)
            self._nr_heap = [(s, b) for s, b in heap if state[b] == NR and stamp[b] == s]
            heapq.heapify(self._nr_heap)

    def on_hit(self, b: int, now: float, cls: int, next_use: int) -> None:
        if self.state[b] == LIR:
            bottom = self.S.front() == b
            self._to_top(b)
            if bottom:
                self._prune()
        elif self._in_s(b):  # resident HIR, recent enough: its new IRR beats the bottom LIR's recency
            self.state[b] = LIR
            self.n_lir += 1
            self._to_top(b)
            self.Q.remove(b)
            if self.n_lir > self.l_lirs:
                self._demote_bottom()
        elif self.n_lir < self.l_lirs:  # room in the LIR set (after removals): LIR, as insert's warm-up does;
            self.state[b] = LIR  # an HIR block pushed onto an S with no LIR below it stayed at S's bottom as
            self.n_lir += 1  # a ghost once evicted, and _demote_bottom later queued that ghost as resident
            self._to_top(b)
            self.Q.remove(b)
        else:  # resident HIR, out of S: stays HIR
            self._to_top(b)
            self.Q.remove(b)
            self.Q.push_back(b)

    def evict(self, now: float) -> int:
        if self.Q.length():
            v = self.Q.pop_front()
            if self._in_s(v):
                self.state[v] = NR
                self.n_nr += 1
                heapq.heappush(self._nr_heap, (int(self.stamp[v]), v))
                self._bound_nonresident()
            else:
                self.state[v] = NONE
        else:  # no resident HIR block (only after the mechanism removed some): the bottom LIR
            v = self.S.pop_front()
            self.state[v] = NONE
            self.n_lir -= 1
            self._prune()
        self.size -= 1
        return v

    def insert(self, b: int, now: float, cls: int, next_use: int) -> None:
        if self.state[b] == NR:
            self.n_nr -= 1
            self.state[b] = LIR
            self.n_lir += 1
            self._to_top(b)
            if self.n_lir > self.l_lirs:
                self._demote_bottom()
        elif self.n_lir < self.l_lirs:  # warm-up: the LIR set is not full yet
            self.state[b] = LIR
            self.n_lir += 1
            self._to_top(b)
        else:
            self.state[b] = HIR
            self._to_top(b)
            self.Q.push_back(b)
        self.size += 1

    def remove(self, b: int) -> None:
        if self.state[b] == LIR:
            self.S.remove(b)
            self.n_lir -= 1
        else:
            self.Q.remove(b)
            self.S.discard(b)
        self.state[b] = NONE
        self._prune()
        self.size -= 1

    def on_freed(self, b: int) -> None:
        if self.state[b] == NR:
            self.S.remove(b)
            self.state[b] = NONE
            self.n_nr -= 1

    def stats(self) -> dict:
        return {"lir": self.n_lir, "nonresident": self.n_nr}


__all__ = ["LIRSPolicy"]
