"""The policy interface shared by the daemon and the replay simulator."""

from __future__ import annotations

import numpy as np

NEVER = np.iinfo(np.int64).max // 2  # ``next_use`` of an access whose block is never used again


class Policy:
    """Hooks called by the cache mechanism for every access.

    ``cls`` is the block's feature class (see ``kvtier.predictor.classes``);
    ``next_use`` is the index of the block's next access and is given only to
    offline policies (``offline = True``) in replay; online ones get -1.
    """

    name = "base"
    offline = False

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

    def insert(self, b: int, now: float, cls: int, next_use: int) -> None:
        raise NotImplementedError

    def remove(self, b: int) -> None:
        """Forget a resident block dropped by the mechanism (not a victim)."""
        raise NotImplementedError

    def admit_many(self, blocks: "np.ndarray", classes: "np.ndarray") -> "np.ndarray":
        """Which of these blocks (feature classes ``classes``, as ``observe`` gets them)
        are worth a slot here, against this tier's current victims? All by default;
        policies with an admission rule override. No state changes."""
        return np.ones(blocks.size, dtype=bool)

    def forget(self, b: int) -> None:
        """Block id ``b`` was released: the next block to take the id starts afresh."""

    def seen(self, b: int) -> bool:
        """Has ``observe`` recorded an access of ``b`` (policies without per-block history: yes)?"""
        return True

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
