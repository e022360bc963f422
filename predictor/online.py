"""The online reuse predictor a policy feeds with every access.

Per block: the Beta state of its prior class after its latest access (class
= feature class x access stage, fitted online by empirical Bayes), forgotten
lazily in closed form while it idles, so P(reuse within H) and the expected
time to reuse are one vectorised expression over any set of blocks. Every
prediction at an access is scored against what happens (Brier, ECE).
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from .beta import BetaReuseModel, forget, p_reuse_within
from .calibration import CalibrationTracker
from .classes import N_CLASSES, N_STAGES
from .priors import ClassPriors


def p_scalar(a: float, b: float, h: float) -> float:
    """1 - B(a, b+h)/B(a, b) with math.lgamma (the per-access fast path)."""
    a = max(a, 1e-12)
    b = max(b, 1e-12)
    return -math.expm1(math.lgamma(b + h) - math.lgamma(a + b + h) - math.lgamma(b) + math.lgamma(a + b))


class OnlineReusePredictor:
    def __init__(self, max_blocks: int, epoch_s: float = 1.0, forgetting: float = 0.99999,
                 prior_window_epochs: float = 2048.0, prior_refit_every: int = 2000, prior_shrink: float = 50.0,
                 horizon_epochs: float = 64.0, track_calibration: bool = True, calibration_bins: int = 10,
                 calibration_window: Optional[int] = None, sample_every: int = 1) -> None:
        if sample_every < 1:
            raise ValueError("sample_every must be >= 1")
        self.sample_every = int(sample_every)  # follow 1 block in N (by a hash of its id): spatial sampling
        self.alpha = np.zeros(max_blocks)
        self.beta = np.zeros(max_blocks)
        self.last = np.zeros(max_blocks)
        self.model = BetaReuseModel(self.alpha, self.beta, self.last, epoch_s, forgetting)
        self.priors = ClassPriors(N_CLASSES, max_blocks, prior_window_epochs, prior_refit_every, prior_shrink)
        self.accesses = np.zeros(max_blocks, dtype=np.int32)
        self.klass = np.zeros(max_blocks, dtype=np.int32)
        self.horizon = float(horizon_epochs)
        self.calib = CalibrationTracker(max_blocks, calibration_bins, calibration_window) if track_calibration else None
        self.epoch = 0.0

    def observe(self, b: int, now: float, cls: int) -> int:
        """Record an access of ``b`` (feature class ``cls``); returns its prior class
        (-1 for a block outside the sample)."""
        if self.sample_every > 1 and ((b * 0x9E3779B1) >> 7) % self.sample_every:
            return -1
        e = now / self.model.epoch_s
        self.epoch = e
        pr = self.priors
        pr.advance(e)
        n = int(self.accesses[b]) + 1
        self.accesses[b] = n
        k = cls * N_STAGES + min(n, N_STAGES) - 1
        self.klass[b] = k
        pr.event(b, k, e)
        a, bb = float(pr.alpha[k]), float(pr.beta[k])
        self.alpha[b] = a
        self.beta[b] = bb
        self.last[b] = e
        if self.calib is not None:
            self.calib.access(b, e)
            self.calib.predict(b, p_scalar(a, bb, self.horizon), e, self.horizon)
        return k

    def on_freed(self, b: int) -> None:
        """Block id ``b`` is gone: its next owner starts unseen (no evidence, no open gap,
        no pending prediction to be scored as a reuse)."""
        self.alpha[b] = self.beta[b] = self.last[b] = 0.0
        self.accesses[b] = 0
        self.klass[b] = 0
        self.priors.on_freed(b)
        if self.calib is not None:
            self.calib.on_freed(b)

    def p_fresh(self, b: int) -> float:
        """P(reuse within the horizon) of a block just accessed."""
        return p_scalar(float(self.alpha[b]), float(self.beta[b]), self.horizon)

    def p_idle(self, blocks: np.ndarray) -> np.ndarray:
        """P(reuse within the horizon) of blocks after their idle time (vectorised)."""
        a, b = forget(self.alpha[blocks], self.beta[blocks], self.epoch - self.last[blocks], self.model.lam)
        return p_reuse_within(a, b, self.horizon)


__all__ = ["OnlineReusePredictor", "p_scalar"]
