"""The Beta value policy (``kvtier-beta``): keep the blocks most likely to be reused.

value(b) = P(reuse within H | b) x weight(importance_b) x cost saved.
P comes from the Beta-Bernoulli predictor: after each access a block's
(alpha, beta) is the empirical-Bayes prior of its class (features x access
stage), and idle epochs are applied lazily with forgetting, so
P(reuse within H | idle k) = 1 - B(a', b'+H)/B(a', b') with (a', b') the
forgotten state. In replay importance and cost are uniform, so the value is P.

Victim search without O(N) work: blocks sit in one LRU list per prior class.
Within a class all blocks share a state at their last access and the
Beta-geometric hazard falls with idle time, so each list's least recent block
is its lowest-value one; the victim is the minimum over list heads (<= 64),
found by one vectorised evaluation. Admission uses the same number: a missed
block enters only if it is worth more than the victim it would displace.

The horizon H is not a tuned constant: it tracks the cache's own
characteristic time (an EWMA of the idle age of evicted blocks), so "worth
keeping" means "likely to be reused before this cache would forget it".
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from kvtier.policy import register_policy
from kvtier.policy.base import Eligible, Policy, list_victims
from kvtier.predictor.classes import N_CLASSES
from kvtier.predictor.online import OnlineReusePredictor
from kvtier.tiers.intrusive import IndexLists


@register_policy("kvtier-beta")
class ValuePolicy(Policy):
    def __init__(self, capacity: int, max_blocks: int, epoch_s: float = 1.0, forgetting: float = 0.99999,
                 prior_window_epochs: float = 2048.0, prior_refit_every: int = 2000, prior_shrink: float = 50.0,
                 horizon_init_epochs: float = 64.0, horizon_smoothing: float = 0.01,
                 admission: bool = True, track_calibration: bool = True, calibration_bins: int = 10,
                 calibration_window: Optional[int] = None, **_: object) -> None:
        super().__init__(capacity, max_blocks)
        self.pred = OnlineReusePredictor(max_blocks, epoch_s, forgetting, prior_window_epochs, prior_refit_every,
                                         prior_shrink, horizon_init_epochs, track_calibration, calibration_bins,
                                         calibration_window)
        p = self.pred
        self.alpha, self.beta, self.last, self.model, self.priors = p.alpha, p.beta, p.last, p.model, p.priors
        self.accesses, self.klass, self.calib = p.accesses, p.klass, p.calib
        self.weight = np.ones(max_blocks)  # importance weight (the daemon sets it; 1 in replay)
        self.lists = IndexLists(max_blocks, n_lists=N_CLASSES)
        self.sentinels = self.lists.capacity + np.arange(N_CLASSES)
        self.smoothing = float(horizon_smoothing)
        self.admission = admission
        self._victim = -1
        self.bypassed = 0

    # -- predictor ---------------------------------------------------------
    def observe(self, b: int, now: float, cls: int) -> None:
        self.pred.observe(b, now, cls)

    @property
    def horizon(self) -> float:
        return self.pred.horizon

    @horizon.setter
    def horizon(self, value: float) -> None:
        self.pred.horizon = value

    @property
    def _epoch(self) -> float:
        return self.pred.epoch

    # -- cache hooks ---------------------------------------------------------
    def on_hit(self, b: int, now: float, cls: int, next_use: int) -> None:
        self.lists.remove(b)
        self.lists.push_back(b, int(self.klass[b]))

    def _find_victim(self) -> tuple[int, float]:
        nonempty = np.flatnonzero(self.lists.lengths)
        heads = self.lists.next[self.sentinels[nonempty]]
        p = self.pred.p_idle(heads) * self.weight[heads]
        i = int(np.argmin(p))
        return int(heads[i]), float(p[i])

    def admit(self, b: int, now: float, cls: int, next_use: int) -> bool:
        if self.size < self.capacity:
            self._victim = -1
            return True
        victim, v_value = self._find_victim()
        self._victim = victim
        if not self.admission:
            return True
        if self.pred.p_fresh(b) * self.weight[b] > v_value:
            return True
        self.bypassed += 1
        return False

    def evict(self, now: float) -> int:
        v = self._victim if self._victim >= 0 else self._find_victim()[0]
        self.on_evict(v, now)
        return v

    def victims(self, n: int, eligible: Optional[Eligible] = None) -> np.ndarray:
        """The ``n`` lowest values among the first ``n`` eligible blocks of every class
        list (within a class, older is worth less: the n lowest overall are among
        these prefixes). No state changes."""
        if n <= 0 or self.size == 0:
            return np.zeros(0, dtype=np.int64)
        parts = [list_victims(self.lists, int(k), n, eligible) for k in np.flatnonzero(self.lists.lengths)]
        cand = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        if cand.size == 0:
            return cand
        v = self.pred.p_idle(cand) * self.weight[cand]
        return cand[np.argsort(v, kind="stable")[:n]]

    def on_evict(self, b: int, now: float) -> None:
        self._victim = -1
        age = self._epoch - self.last[b]
        self.horizon += self.smoothing * (max(age, 1.0) - self.horizon)
        self.lists.remove(b)
        self.size -= 1

    def on_freed(self, b: int) -> None:
        self.weight[b] = 1.0
        self.pred.on_freed(b)

    def insert(self, b: int, now: float, cls: int, next_use: int) -> None:
        self.lists.push_back(b, int(self.klass[b]))
        self.size += 1

    def remove(self, b: int) -> None:
        self.lists.remove(b)
        self.size -= 1

    def set_weights(self, blocks: np.ndarray, weights: np.ndarray) -> None:
        self.weight[blocks] = weights

    def stats(self) -> dict:
        return {"horizon_epochs": self.horizon, "bypassed": self.bypassed,
                "class_alpha": self.priors.alpha.tolist(), "class_beta": self.priors.beta.tolist()}
