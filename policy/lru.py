"""Least recently used: what LMCache, SGLang, vLLM and Dynamo ship."""

from __future__ import annotations

from typing import Optional

import numpy as np

from kvtier.policy import register_policy
from kvtier.policy.base import NEVER, Eligible, Policy, list_victims
from kvtier.tiers.intrusive import IndexLists


@register_policy("lru")
class LRUPolicy(Policy):
    def __init__(self, capacity: int, max_blocks: int, **_: object) -> None:
        super().__init__(capacity, max_blocks)
        self.order = IndexLists(max_blocks)  # front = least recent

    def on_hit(self, b: int, now: float, cls: int, next_use: int) -> None:
        self.order.remove(b)
        self.order.push_back(b)

    def evict(self, now: float) -> int:
        self.size -= 1
        return self.order.pop_front()

    def victims(self, n: int, eligible: Optional[Eligible] = None) -> np.ndarray:
        return list_victims(self.order, 0, n, eligible)

    def insert(self, b: int, now: float, cls: int, next_use: int) -> None:
        self.order.push_back(b)
        self.size += 1

    def remove(self, b: int) -> None:
        self.order.remove(b)
        self.size -= 1


@register_policy("lru-oracle-admit")
class OracleAdmissionLRUPolicy(LRUPolicy):
    """LRU that admits a missed block only if it will ever be read again (offline).

    A replay-only reference: how much of the LRU -> Belady gap perfect admission
    alone would close, with eviction order left to recency. On the Mooncake
    conversation trace it is the bound for any policy whose gain comes from
    admission (three quarters of blocks there are never reused)."""

    offline = True

    def admit(self, b: int, now: float, cls: int, next_use: int) -> bool:
        return next_use < NEVER
