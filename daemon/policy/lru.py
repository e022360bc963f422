"""Least recently used: what LMCache, SGLang, vLLM and Dynamo ship."""

from __future__ import annotations

from kvtier.tiers.intrusive import IndexLists

from . import register_policy
from .base import Policy


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

    def insert(self, b: int, now: float, cls: int, next_use: int) -> None:
        self.order.push_back(b)
        self.size += 1

    def remove(self, b: int) -> None:
        self.order.remove(b)
        self.size -= 1
