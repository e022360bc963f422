"""``kvtier-prefit``: kvtier with its reuse model fitted on the whole trace before the first access.

A hindsight reference for ``kvtier replay``, beside Belady and
``lru-oracle-admit``: it separates what kvtier loses to learning online from
what its features cannot tell. A first pass replays the trace through an
ordinary ``kvtier`` cache of the same capacity with no forgetting and keeps
its final evidence: every reuse distance per cell, every access, and the
accesses still pending at the end (censored at their age). The second pass is
the shipped policy (same candidates, shadow caches, admission and victims)
whose tables are built from that evidence before its first access and at every
refresh, its own counts added as it goes (by the end of the replay it has
counted the trace twice), so from the first access it knows each cell's
reuse-distance law over the whole trace, and the run's mean eviction age,
though not which block comes back when. Neither pass forgets (the statistics
are the trace's, not a window's), so ``memory_horizons`` is the one
``[policy]`` parameter it does not take. Its replay runs through the compiled
loop: no hook is overridden, and refreshes run in Python.

It sees the future (the trace's statistics), so it is ``offline``: the
multi-tier replay and the daemon refuse it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

from kvtier.policy import register_policy
from kvtier.policy.value import Runner, ValuePolicy

if TYPE_CHECKING:
    from kvtier.replay.traces import Trace

NO_FORGETTING = 1e12  # memory in eviction ages: the counts keep every access


@register_policy("kvtier-prefit")
class PrefitValuePolicy(ValuePolicy):
    offline = True  # the trace's statistics are its future
    replay_only = True
    passes = 2  # replay runs the trace twice for it (its progress counts both)
    config_params = True  # replay gives it kvtier's [policy] parameters

    def __init__(self, capacity: int, max_blocks: int, **params: Any) -> None:
        self._params = {**params, "memory_horizons": NO_FORGETTING, "track_calibration": False}
        super().__init__(capacity, max_blocks, **self._params)
        self.prepared = False

    def prepare(self, trace: "Trace", progress: Optional[Callable[[int], None]] = None) -> None:
        """The first pass: fit the model on ``trace`` and preload its evidence."""
        from kvtier.replay.sim import simulate  # replay imports the policies, not the reverse

        first = ValuePolicy(self.capacity, self.max_blocks, **self._params)
        simulate(first, trace, progress=progress)
        self.model.preload(*first.model.evidence())
        self.model.eviction_age = first.model.eviction_age  # the run's mean: the horizons from the start
        self.model.refresh()  # the tables from the evidence now, not at the first refresh of the replay
        self.prepared = True

    def compiled_replay(self, blocks: np.ndarray, classes: np.ndarray, resident: np.ndarray) -> Optional[Runner]:
        if not self.prepared:
            raise RuntimeError("kvtier-prefit: prepare(trace) must run before the replay")
        return super().compiled_replay(blocks, classes, resident)

    def calibration(self) -> None:
        return None  # a reference for hit ratios: its probabilities are fitted on what they predict


__all__ = ["PrefitValuePolicy"]
