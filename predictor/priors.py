"""Class priors for new blocks, fitted online by empirical Bayes.

After each access a block takes the Beta state of its class (features known
when it is written: position, segment type, tenant, turn, ... crossed with
its access stage). For each class we collect the gap from an access to the
block's next access, binned on a log2
grid of epochs and right-censored at ``window`` epochs (blocks not reused by
then count as survivors). Periodically each class's (alpha, beta) is refitted
by maximising the Beta-geometric likelihood of those binned gaps over a
log-spaced grid (type-II maximum likelihood). Classes are shrunk towards the
pooled distribution with ``shrink`` pseudo-blocks, so sparse classes borrow
strength from the rest (the hierarchical part).
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np
from scipy.special import betaln


class ClassPriors:
    def __init__(self, n_classes: int, max_blocks: int, window_epochs: float = 1024.0,
                 refit_every: int = 2000, shrink: float = 50.0,
                 default: tuple[float, float] = (0.5, 50.0)) -> None:
        if n_classes < 1 or window_epochs <= 1:
            raise ValueError("need n_classes >= 1 and window_epochs > 1")
        self.n_classes = int(n_classes)
        self.window = float(window_epochs)
        n_bins = int(np.ceil(np.log2(self.window))) + 1
        self.edges = np.concatenate(([0.0], 2.0 ** np.arange(n_bins - 1)))
        self.edges = np.append(self.edges[self.edges < self.window], self.window)
        self.hist = np.zeros((self.n_classes, self.edges.size), dtype=np.float64)  # last col: survivors
        self.refit_every = int(refit_every)
        self.shrink = float(shrink)
        self.alpha = np.full(self.n_classes, default[0])
        self.beta = np.full(self.n_classes, default[1])
        self.born_class = np.full(max_blocks, -1, dtype=np.int32)
        self.born_epoch = np.zeros(max_blocks, dtype=np.float64)
        self.pending = np.zeros(max_blocks, dtype=bool)
        self._births: deque[tuple[float, int]] = deque()
        self._since_refit = 0
        ga = np.logspace(-2.5, 1.5, 41)
        gb = np.logspace(-1, 4.5, 56)
        self._grid_a, self._grid_b = [g.ravel() for g in np.meshgrid(ga, gb, indexing="ij")]
        # log-probability of each gap bin (and survival) for every grid point
        lb0 = betaln(self._grid_a, self._grid_b)
        surv = np.exp(betaln(self._grid_a[:, None], self._grid_b[:, None] + self.edges[None, :]) - lb0[:, None])
        probs = np.concatenate((surv[:, :-1] - surv[:, 1:], surv[:, -1:]), axis=1)
        self._grid_logp = np.log(np.maximum(probs, 1e-300))
        self._grid_logs = np.log(np.maximum(surv, 1e-300))  # log S(edge) per grid point
        self._now = 0.0

    def prior(self, classes: "int | np.ndarray") -> tuple[np.ndarray, np.ndarray]:
        return self.alpha[classes], self.beta[classes]

    def event(self, block: int, cls: int, epoch: float) -> None:
        """An access: resolves the block's pending gap, opens a new one in ``cls``."""
        if not 0 <= cls < self.n_classes:
            raise ValueError(f"class {cls} out of range [0, {self.n_classes})")
        if self.pending[block]:
            age = epoch - self.born_epoch[block]
            # a reuse at age x falls in epoch G = ceil(x) >= 1; bin j holds
            # G in (edges[j], edges[j+1]], probability S(edges[j]) - S(edges[j+1])
            g = max(1.0, math.ceil(age))
            j = int(np.searchsorted(self.edges, g, side="left")) - 1 if g <= self.window else -1
            self.hist[self.born_class[block], j] += 1.0
            self._count()
        self.born_class[block] = cls
        self.born_epoch[block] = epoch
        self.pending[block] = True
        self._births.append((epoch, block))
        if len(self._births) > 2 * self.pending.size + 1024:
            self._compact()

    def on_freed(self, block: int) -> None:
        """``block`` is gone: its open gap is dropped (a later owner of the id must not
        resolve it as a reuse); its queued birth is skipped when it comes due."""
        self.pending[block] = False
        self.born_class[block] = -1
        self.born_epoch[block] = 0.0

    def _compact(self) -> None:
        """Keep one birth per pending block (its newest): the queue holds one entry per
        access, and only the newest of a block counts, so without this it grows with
        the access rate times the window. Amortised O(1) per event; bound 2 x max_blocks."""
        live = np.flatnonzero(self.pending)
        order = np.argsort(self.born_epoch[live], kind="stable")
        self._births = deque(zip(self.born_epoch[live][order].tolist(), live[order].tolist()))

    def advance(self, epoch: float) -> None:
        """Gaps open longer than the window are resolved as 'no reuse'."""
        self._now = max(self._now, epoch)
        births = self._births
        while births and epoch - births[0][0] >= self.window:
            e, b = births.popleft()
            if self.pending[b] and self.born_epoch[b] == e:
                self.pending[b] = False
                self.hist[self.born_class[b], -1] += 1.0
                self._count()

    def _count(self) -> None:
        self._since_refit += 1
        if self._since_refit >= self.refit_every:
            self.refit()

    def censored(self) -> np.ndarray:
        """Open gaps by class and age bin: they survived at least that long.

        Leaving them out would bias early fits towards reuse (only reuses
        resolve quickly); they enter the likelihood as log S(bin start).
        """
        open_ = np.flatnonzero(self.pending)
        out = np.zeros((self.n_classes, self.edges.size), dtype=np.float64)
        if open_.size:
            age = self._now - self.born_epoch[open_]
            j = np.clip(np.searchsorted(self.edges, age, side="right") - 1, 0, self.edges.size - 1)
            np.add.at(out, (self.born_class[open_], j), 1.0)
        return out

    def refit(self) -> None:
        self._since_refit = 0
        cens = self.censored()
        total = self.hist.sum(axis=0) + cens.sum(axis=0)
        if total.sum() <= 0:
            return
        pooled_hist = self.hist.sum(axis=0)
        pooled_cens = cens.sum(axis=0)
        scale = self.shrink / total.sum()
        counts = self.hist + scale * pooled_hist[None, :]
        cens = cens + scale * pooled_cens[None, :]
        ll = counts @ self._grid_logp.T + cens @ self._grid_logs.T  # [classes, grid]
        best = np.argmax(ll, axis=1)
        self.alpha = self._grid_a[best].copy()
        self.beta = self._grid_b[best].copy()

    def observed_reuse_fraction(self) -> np.ndarray:
        n = self.hist.sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(n > 0, 1.0 - self.hist[:, -1] / n, np.nan)
