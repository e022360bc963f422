"""The policy interface shared by the daemon and the replay simulator."""

from __future__ import annotations

import copy
from typing import Callable, Optional

import numpy as np

from kvtier.tiers.intrusive import IndexLists

NEVER = np.iinfo(np.int64).max // 2  # ``next_use`` of an access whose block is never used again

Eligible = Callable[[np.ndarray], np.ndarray]
"""Vectorised predicate over block ids: which of them may be evicted now (not pinned, busy, hinted)."""


def budget(n: int) -> int:
    """Most candidates a victim query looks at for ``n`` victims: a tier full of pinned
    blocks must not turn a query into an O(N) scan."""
    return 4 * n + 64


def _ok(cand: np.ndarray, eligible: Optional[Eligible]) -> np.ndarray:
    return cand if eligible is None or cand.size == 0 else cand[np.asarray(eligible(cand), dtype=bool)]


def list_victims(lists: IndexLists, lst: int, n: int, eligible: Optional[Eligible]) -> np.ndarray:
    """Up to ``n`` eligible elements of list ``lst`` from its front (the eviction end),
    looking at no more than ``budget(n)`` of them. Reads the links only."""
    out: list[np.ndarray] = []
    found = 0
    left = budget(n)
    s = lists.sentinel(lst)
    e = int(lists.next[s])
    nxt = lists.next
    while found < n and e != s and left > 0:
        chunk: list[int] = []
        k = min(left, 2 * (n - found) + 8)
        while e != s and len(chunk) < k:
            chunk.append(e)
            e = int(nxt[e])
        left -= len(chunk)
        ok = _ok(np.asarray(chunk, dtype=np.int64), eligible)
        out.append(ok[: n - found])
        found += int(out[-1].size)
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def swap_remove(slots: np.ndarray, where: np.ndarray, size: int, b: int) -> int:
    """Remove ``b`` from a dense resident array ``slots[:size]`` with reverse index ``where``
    in O(1) (the last resident takes its place); returns the new size. Sampled-eviction
    policies keep residents so, for O(1) uniform sampling."""
    i = int(where[b])
    last = int(slots[size - 1])
    slots[i] = last
    where[last] = i
    where[b] = -1
    return size - 1


def swap_remove_many(slots: np.ndarray, where: np.ndarray, size: int, blocks: np.ndarray) -> int:
    """``swap_remove`` of distinct residents ``blocks`` at once, in O(k) for k blocks: the
    residents left past the new end fill the holes the removed leave before it. Which
    resident sits where may differ from one-by-one removal, which a sampling policy does
    not depend on: ``slots[:size]`` holds the same set."""
    k = int(blocks.size)
    if k == 0:
        return size
    pos = where[blocks]
    if (pos < 0).any():
        raise ValueError(f"block {int(blocks[np.argmax(pos < 0)])} is not a resident")
    end = size - k
    holes = pos[pos < end]  # (any pairing of holes and movers will do)
    leaving = np.zeros(k, dtype=bool)  # the tail's positions whose block is removed too
    leaving[pos[pos >= end] - end] = True
    movers = slots[end:size][~leaving]
    slots[holes] = movers
    where[movers] = holes
    where[blocks] = -1
    return end


class Policy:
    """Hooks called by the cache mechanism for every access.

    ``cls`` is the block's feature class (see ``kvtier.predictor.classes``);
    ``next_use`` is the index of the block's next access and is given only to
    offline policies (``offline = True``) in replay; online ones get -1.

    Two ways to take victims: replay calls ``evict`` (choose and unlink one);
    the daemon, whose residents may be pinned, busy or hinted, asks
    ``victims(n, eligible)`` (a pure query) and then reports each block it
    actually evicts with ``on_evict``, so skipped blocks keep their place and
    history. ``replay_only`` policies answer ``victims`` by simulating
    evictions on a copy of themselves (O(state)): they are references for
    ``kvtier replay`` and the daemon's config refuses them.
    """

    name = "base"
    offline = False
    replay_only = False

    def __init__(self, capacity: int, max_blocks: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1 block")
        self.capacity = int(capacity)
        self.max_blocks = int(max_blocks)
        self.size = 0

    def observe(self, b: int, now: float, cls: int) -> None:
        """Every access, before hit/miss handling (predictor updates)."""

    def on_hit(self, b: int, now: float, cls: int, next_use: int) -> None:
        raise NotImplementedError

    def admit(self, b: int, now: float, cls: int, next_use: int) -> bool:
        """Should a missed block enter the cache? (bypass when False)"""
        return True

    def evict(self, now: float) -> int:
        """Choose, unlink and return one victim."""
        raise NotImplementedError

    def victims(self, n: int, eligible: Optional[Eligible] = None) -> np.ndarray:
        """Up to ``n`` residents for which ``eligible`` holds, in eviction order, WITHOUT
        changing any state of the policy (ineligible blocks are skipped, not evicted).

        Fallback: evictions simulated on a deep copy, O(state); policies the daemon
        runs override it with an incremental query."""
        if n <= 0 or self.size == 0:
            return np.zeros(0, dtype=np.int64)
        shadow = copy.deepcopy(self)
        out: list[int] = []
        left = budget(n)
        while len(out) < n and shadow.size > 0 and left > 0:
            v = shadow.evict(0.0)
            left -= 1
            if eligible is None or bool(np.asarray(eligible(np.array([v], dtype=np.int64)))[0]):
                out.append(v)
        return np.asarray(out, dtype=np.int64)

    def on_evict(self, b: int, now: float) -> None:
        """The mechanism evicted resident ``b``, a block ``victims`` returned: record the
        eviction as ``evict`` would have (ghosts, statistics) and unlink it."""
        self.remove(b)

    def insert(self, b: int, now: float, cls: int, next_use: int) -> None:
        raise NotImplementedError

    def remove(self, b: int) -> None:
        """Forget a resident block dropped by the mechanism (not a victim)."""
        raise NotImplementedError

    def remove_many(self, blocks: "np.ndarray") -> None:
        """``remove`` of each block (a move's blocks leaving at once); policies whose
        residents are a dense array do it in one step."""
        for b in blocks.tolist():
            self.remove(b)

    def insert_many(self, blocks: "np.ndarray", now: float, classes: "np.ndarray") -> None:
        """``insert`` of each block in order (a move's blocks landing at once); policies whose
        insert is an append do it in one step."""
        for b, cls in zip(blocks.tolist(), classes.tolist()):
            self.insert(b, now, cls, -1)

    def admit_many(self, blocks: "np.ndarray", classes: "np.ndarray") -> "np.ndarray":
        """Which of these blocks (feature classes ``classes``, as ``observe`` gets them)
        are worth a slot here, against this tier's current victims? All by default;
        policies with an admission rule override. No state changes."""
        return np.ones(blocks.size, dtype=bool)

    def on_freed(self, b: int) -> None:
        """Block id ``b`` no longer exists (in no tier): reset every per-block entry, so the
        next block to take the id starts as a never-seen one (no inherited history,
        weight or pending prediction). ``b`` is not resident in this policy."""

    def seen(self, b: int) -> bool:
        """Has ``observe`` recorded an access of ``b`` (policies without per-block history: yes)?"""
        return True

    def seen_many(self, blocks: "np.ndarray") -> "np.ndarray":
        """``seen`` per block."""
        return np.array([self.seen(b) for b in blocks.tolist()], dtype=bool)

    def residents(self) -> "Optional[np.ndarray]":
        """The block ids this policy holds, where it can list them cheaply (None: it cannot),
        so a replay can continue a policy that already holds blocks."""
        return None

    def best(self, k: int) -> "np.ndarray":
        """Up to ``k`` residents worth the most (speculative promotion); none by default."""
        return np.zeros(0, dtype=np.int64)

    def set_weights(self, blocks: "np.ndarray", weights: "np.ndarray") -> None:
        """Importance weights from the daemon's scoring (policies that use them override)."""

    def calibration(self) -> "dict | None":
        """Brier/ECE of the policy's scored predictions (None: it makes none)."""
        return None

    def stats(self) -> dict:
        return {}
