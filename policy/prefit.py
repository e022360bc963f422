"""``kvtier-prefit``: kvtier with its reuse model fitted on the whole trace before the first access.

A hindsight reference for ``kvtier replay``, beside Belady and
``lru-oracle-admit``: it separates what kvtier loses to learning online from
what its features cannot tell. A first pass feeds every access of the trace
to a reuse model of its own with no forgetting (the model's evidence is read
off the access stream, whatever a cache keeps, so no cache is simulated) and
keeps its final evidence: every reuse distance per cell, every access, and
the accesses still pending at the end (censored at their age). The replay is
then the shipped policy (same candidates, shadow caches, admission and
victims) whose tables are built from that evidence before its first access
and at every refresh, its own counts added as it goes (by the end it has
counted the trace twice), so from the first access it knows each cell's
reuse-distance law over the whole trace, though not which block comes back
when. Neither forgets (the statistics are the trace's, not a window's), so
``memory_horizons`` is the one ``[policy]`` parameter it does not take. Its
replay runs through the compiled loop: no hook is overridden, and refreshes
run in Python.

It sees the future (the trace's statistics), so it is ``offline``: the
multi-tier replay and the daemon refuse it.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from kvtier.policy import register_policy
from kvtier.policy.value import ValuePolicy
from kvtier.predictor.reuse_model import ReuseModel

NO_FORGETTING = 1e12  # memory in eviction ages: the counts keep every access
PROGRESS_EVERY = 20_000  # accesses between progress reports of the first pass


@register_policy("kvtier-prefit")
class PrefitValuePolicy(ValuePolicy):
    offline = True  # the trace's statistics are its future
    replay_only = True
    passes = 2  # replay reads the trace twice for it (its progress counts both)
    config_params = True  # replay gives it kvtier's [policy] parameters

    def __init__(self, capacity: int, max_blocks: int, **params: Any) -> None:
        super().__init__(capacity, max_blocks, **{**params, "memory_horizons": NO_FORGETTING,
                                                  "track_calibration": False})
        self.prepared = False  # replay refuses it until ``prepare``

    def prepare(self, blocks: np.ndarray, classes: np.ndarray,
                progress: Optional[Callable[[int], None]] = None) -> None:
        """The first pass: the trace's accesses (block ids, feature classes, in order) into a
        model of their own, whose evidence this policy's model then reads at every refresh."""
        m = self.model
        first = ReuseModel(self.max_blocks, m.candidates, m.m, m.refresh_every, NO_FORGETTING,
                           initial_age=float(self.capacity))
        for start in range(0, len(blocks), PROGRESS_EVERY):
            for b, c in zip(blocks[start: start + PROGRESS_EVERY].tolist(),
                            classes[start: start + PROGRESS_EVERY].tolist()):
                first.access(b, c)
            if progress is not None:
                progress(min(PROGRESS_EVERY, len(blocks) - start))
        m.preload(*first.evidence())
        m.refresh()  # the tables from the evidence now, not at the replay's first refresh
        self.prepared = True

    def calibration(self) -> None:
        return None  # a reference for hit ratios: its probabilities are fitted on what they predict


__all__ = ["NO_FORGETTING", "PrefitValuePolicy"]
