"""Placement policies, looked up by name (config ``policy.name``).

A policy is mechanism-free: it sees block ids, the clock and a block class,
and answers admission and victim questions with incremental structures
(intrusive lists, heaps): no O(N) work per eviction. The replay simulator and
the daemon call the very same objects.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from kvtier.policy.base import Policy

POLICIES: dict[str, Callable[..., Policy]] = {}

_PolicyClass = TypeVar("_PolicyClass", bound=type[Policy])


def register_policy(name: str) -> Callable[[_PolicyClass], _PolicyClass]:
    def deco(cls: _PolicyClass) -> _PolicyClass:
        cls.name = name
        POLICIES[name] = cls
        return cls
    return deco


def make_policy(name: str, capacity: int, max_blocks: int, **params: Any) -> Policy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {sorted(POLICIES)}") from None
    return factory(capacity, max_blocks, **params)


from kvtier.policy import arc, belady, gdsf, lhd, lirs, lru, s3fifo, sieve, tinylfu, twoq, value  # noqa: E402,F401,I001
from kvtier.policy import prefit  # noqa: E402,F401  (after value: it subclasses it)

__all__ = ["POLICIES", "Policy", "make_policy", "register_policy"]
