"""Online recalibration of the reuse probabilities the policy states for its decisions.

The reuse model is fitted on every access, but its probabilities are stated for
the decisions the policy takes: misses it considers admitting and residents it
evicts, populations the model's cells do not tell apart from the rest (a miss
says the block came back late; the victim is the lowest of a sample), and on a
drifting workload its counts lag. Measured on the decisions, its probabilities
read 1.5-2x the observed rate at mid values on a Zipf family.

So the stated probability goes through a map learned from the outcomes of
earlier stated predictions: per bin of the model's probability (``BINS``
equal-width bins), the decayed share of predictions reused within their
window, shrunk towards the bins' mean prediction with ``PSEUDO_COUNT``
pseudo-predictions and made non-decreasing by pool-adjacent-violators. A bin
with no evidence yet states the model's own probability, held between its
neighbours' (the map is stored as a floor and a ceiling per bin, equal where
there is evidence), so a higher model probability never states less. The map is causal: a prediction enters it only once
its window has closed, counted by the period its deadline falls in, reuses and
all; counted at resolution, reuses arrive early and misses late, and every bin
would read high. Decisions still rank by the model's probability (the map only
states it), so hit ratios do not change; ``ece_raw`` reports the model's own.

A freed block's pending prediction leaves its period's counts (as the tracker drops
its pair). Predictions whose deadline is more than ``RING`` periods ahead (a
density model's 128 eviction ages on a large cache) are not tracked
(``untracked``): they state the map of their model, learned from the rest.
Past ~2^29 accesses float32 deadlines round by more than an access and a reuse
just after its period closed may be scored in the pairs but not counted here.

Cost: a byte a block (the prediction's model and bin, to count its reuse), a ring
of ``RING`` periods x models x ``BINS`` counts, and O(models x BINS) a refresh.
"""

from __future__ import annotations

import math

import numpy as np

BINS = 20  # equal-width bins of the model's probability (two per bin of a 10-bin ECE)
RING = 512  # deadline periods ahead a prediction may fall and still train the map
PSEUDO_COUNT = 4.0  # pseudo-predictions at the bin's mean model probability
UNTRACKED = 255  # a prediction's bin when it does not train the map (deadline beyond the ring)


def bin_of(p: float) -> int:
    """The bin of model probability ``p`` (float32, as stored), as the replay kernel computes
    it; ``UNTRACKED`` for NaN."""
    x = float(np.float32(p)) * BINS
    if x != x:
        return UNTRACKED
    return 0 if x < 0.0 else BINS - 1 if x >= BINS - 1 else int(x)


def pool_adjacent_violators(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The non-decreasing fit of ``y`` with weights ``w`` (least squares)."""
    vals: list[float] = []
    wts: list[float] = []
    lens: list[int] = []
    for yi, wi in zip(y.tolist(), w.tolist()):
        vals.append(yi)
        wts.append(wi)
        lens.append(1)
        while len(vals) > 1 and vals[-2] > vals[-1]:
            v2, w2, n2 = vals.pop(), wts.pop(), lens.pop()
            v1, w1, n1 = vals.pop(), wts.pop(), lens.pop()
            vals.append((v1 * w1 + v2 * w2) / (w1 + w2))
            wts.append(w1 + w2)
            lens.append(n1 + n2)
    return np.repeat(np.asarray(vals), lens)


class Recalibrator:
    """Per candidate model, the map from its probability to the stated one, and the counts
    it is learned from (a prediction is known by its code: model x ``BINS`` + bin).

    ``period`` accesses make one deadline period; the owner calls ``fold`` once per
    period (the model's refresh), which closes every period before ``now``."""

    def __init__(self, period: int, models: int = 1) -> None:
        if period < 1 or not 1 <= models * BINS <= UNTRACKED:
            raise ValueError(f"period >= 1 access, 1 <= models <= {UNTRACKED // BINS}")
        self.period = int(period)
        self.models = int(models)
        codes = self.models * BINS
        # per (deadline period mod RING, code): predictions made, their model probabilities, reuses
        self.due_n = np.zeros((RING, codes))
        self.due_p = np.zeros((RING, codes))
        self.reused = np.zeros((RING, codes))
        self.folded = 0  # periods before this one are closed and in the totals
        self.n = np.zeros(codes)  # closed, decayed
        self.sum_p = np.zeros(codes)
        self.sum_y = np.zeros(codes)
        self.all_n = np.zeros(codes)  # closed, not decayed: the model's own calibration (``ece_raw``)
        self.all_p = np.zeros(codes)
        self.all_y = np.zeros(codes)
        # the stated probability: the model's, clamped to [floor, ceiling] of its code
        self.floor = np.zeros(codes, dtype=np.float32)
        self.ceiling = np.ones(codes, dtype=np.float32)
        self.untracked = 0  # predictions stated but not tracked (deadline past the ring)

    def _slot(self, deadline: float) -> int:
        """The ring row of ``deadline``'s period (float32, as stored), -1 outside the ring
        (or not a number), compared before any conversion, as the replay kernel does."""
        q = float(np.float32(deadline)) / self.period
        if not self.folded <= q < self.folded + RING:
            return -1
        return math.floor(q) % RING

    def track(self, k: int, p: float, deadline: float) -> int:
        """Model ``k`` stated a prediction of its probability ``p``, window ending at
        ``deadline``: its code, or ``UNTRACKED`` where its period is outside the ring."""
        b, slot = bin_of(p), self._slot(deadline)
        if b == UNTRACKED or slot < 0:
            self.untracked += 1
            return UNTRACKED
        code = k * BINS + b
        self.due_n[slot, code] += 1.0
        self.due_p[slot, code] += float(np.float32(p))
        return code

    def reuse(self, code: int, deadline: float) -> None:
        """A tracked prediction (``code``) was reused within its window."""
        slot = self._slot(deadline)
        if code != UNTRACKED and slot >= 0:
            self.reused[slot, code] += 1.0

    def drop(self, code: int, deadline: float) -> None:
        """A tracked prediction will never resolve (its block was freed): out of its
        period's counts, if still open (its probability taken as its bin's mean there)."""
        slot = self._slot(deadline)
        if code != UNTRACKED and slot >= 0 and self.due_n[slot, code] >= 1.0:
            self.due_p[slot, code] -= self.due_p[slot, code] / self.due_n[slot, code]
            self.due_n[slot, code] -= 1.0

    def state(self, k: int, p: float) -> float:
        """The probability stated for model ``k``'s probability ``p`` (float32)."""
        b = bin_of(p)
        q = np.float32(p)
        if b == UNTRACKED:
            return float(q)
        lo, hi = self.floor[k * BINS + b], self.ceiling[k * BINS + b]
        return float(lo if q < lo else hi if q > hi else q)

    def fold(self, now: int, decay: float) -> None:
        """Close every period before ``now``'s: their counts join the totals (each older
        period's weight times ``decay``), and the maps are rebuilt."""
        current = now // self.period
        closing = range(self.folded, current)[-RING:]
        if not closing:
            return
        for period in closing:
            s = period % RING
            for tot in (self.n, self.sum_p, self.sum_y):
                tot *= decay
            for tot, every, row in ((self.n, self.all_n, self.due_n), (self.sum_p, self.all_p, self.due_p),
                                    (self.sum_y, self.all_y, self.reused)):
                tot += row[s]
                every += row[s]
                row[s] = 0.0
        self.folded = current
        for k in range(self.models):
            at = slice(k * BINS, (k + 1) * BINS)
            n = self.n[at]
            seen = np.flatnonzero(n > 0)
            if not seen.size:
                self.floor[at], self.ceiling[at] = 0.0, 1.0
                continue
            w = n[seen] + PSEUDO_COUNT
            fit = pool_adjacent_violators((self.sum_y[at][seen] + PSEUDO_COUNT * self.sum_p[at][seen] / n[seen]) / w, w)
            # a bin without evidence: between the nearest bins with evidence below and above it
            below = np.searchsorted(seen, np.arange(BINS), side="right") - 1
            above = np.searchsorted(seen, np.arange(BINS), side="left")
            self.floor[at] = np.where(below >= 0, fit[np.maximum(below, 0)], 0.0)
            self.ceiling[at] = np.where(above < seen.size, fit[np.minimum(above, seen.size - 1)], 1.0)

    def raw_ece(self, n_bins: int = 10) -> float:
        """The model's own expected calibration error over the closed predictions, in
        ``n_bins`` equal-width bins (a divisor of ``BINS``)."""
        if BINS % n_bins:
            raise ValueError(f"n_bins must divide {BINS}")
        g = BINS // n_bins
        n, p, y = (a.reshape(self.models, n_bins, g).sum((0, 2)) for a in (self.all_n, self.all_p, self.all_y))
        total = n.sum()
        return float(np.abs(p - y).sum() / total) if total else float("nan")
