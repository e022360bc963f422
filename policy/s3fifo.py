"""S3-FIFO (Yang et al., SOSP'23): small FIFO, main FIFO, ghost FIFO.

10% small queue, frequency capped at 3, promotion to main at frequency >= 1,
ghost of main's size; the configuration of the reference figures.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

import numpy as np

from kvtier.policy import register_policy
from kvtier.policy.base import Eligible, Policy, budget
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

    def victims(self, n: int, eligible: Optional[Eligible] = None) -> np.ndarray:
        """``evict``'s loop run on a virtual copy of the queues: promotions to main and
        main's second chances are tracked in local variables, never written back.
        Ineligible blocks keep their place, as ``on_evict`` steps over them."""
        q, freq, nxt = self.q, self.freq, self.q.next
        ok = (lambda b: True) if eligible is None else (lambda b: bool(eligible(np.array([b]))[0]))
        n_small, n_main = q.length(SMALL), q.length(MAIN)
        s_end, m_end = q.sentinel(SMALL), q.sentinel(MAIN)
        e_small, e_main = int(nxt[s_end]), int(nxt[m_end])
        tail: deque[tuple[int, int]] = deque()  # main's virtual tail: (block, freq)
        out: list[int] = []
        left = budget(n)
        while len(out) < n and left > 0:
            left -= 1
            if (n_small >= self.small_cap or n_main == 0) and e_small != s_end:
                b, e_small = e_small, int(nxt[e_small])
                if freq[b] >= self.move_threshold:
                    tail.append((b, 0))
                    n_small, n_main = n_small - 1, n_main + 1
                elif ok(b):
                    out.append(b)
                    n_small -= 1
                continue
            if e_main != m_end:
                b, f = e_main, int(freq[e_main])
                e_main = int(nxt[e_main])
            elif tail:
                b, f = tail.popleft()
            else:
                break
            if f > 0:
                tail.append((b, f - 1))
            elif ok(b):
                out.append(b)
                n_main -= 1
        return np.asarray(out, dtype=np.int64)

    def on_evict(self, b: int, now: float) -> None:
        """What ``evict`` does on its way to ``b``: blocks ahead of it in its queue get
        their promotion or second chance; ineligible ones ahead of it stay put."""
        q, freq, nxt = self.q, self.freq, self.q.next
        where = q.list_of(b)
        e = q.front(where)
        while e != b:
            after = int(nxt[e])
            if where == SMALL and freq[e] >= self.move_threshold:
                q.remove(e)
                freq[e] = 0
                q.push_back(e, MAIN)
            elif where == MAIN and freq[e] > 0:
                freq[e] -= 1
                q.remove(e)
                q.push_back(e, MAIN)
            e = after
        q.remove(b)
        if where == SMALL:
            if q.length(GHOST) >= self.ghost_cap:
                q.pop_front(GHOST)
            q.push_back(b, GHOST)
        self.size -= 1

    def remove(self, b: int) -> None:
        self.q.remove(b)
        self.size -= 1

    def on_freed(self, b: int) -> None:
        if self.q.list_of(b) == GHOST:
            self.q.remove(b)
        self.freq[b] = 0
