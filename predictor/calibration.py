"""Calibration of reuse predictions: Brier score and expected calibration error.

Predictions are made at each access ("reused within H epochs?"); the outcome
is known at the block's next access or once the deadline passes. Pending
predictions are held per block, so tracking costs O(1) per access.

In replay (every pair kept), a pair is scored only once its deadline has
passed, however early it resolved: a reuse is known at once, a non-reuse only
at the deadline, so at the end of a replay every window not yet closed would
hold its reuses and none of its misses. A daemon's ring is not filtered: in a
steady state reuses and misses enter it at their true rates (only later for
misses), and a filter by deadline would keep the misses but drop the early
reuses the ring had already overwritten.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from kvtier.predictor.recalibration import BINS, UNTRACKED, Recalibrator


def brier(p: np.ndarray, y: np.ndarray) -> float:
    p = np.asarray(p, dtype=np.float64)
    return float(np.mean((p - np.asarray(y, dtype=np.float64)) ** 2)) if p.size else float("nan")


def reliability(p: np.ndarray, y: np.ndarray, n_bins: int = 10) -> dict[str, np.ndarray]:
    """Per equal-width bin: count, mean prediction, observed frequency."""
    p = np.asarray(p, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    idx = np.minimum((p * n_bins).astype(np.int64), n_bins - 1)
    count = np.bincount(idx, minlength=n_bins).astype(np.float64)
    sp = np.bincount(idx, weights=p, minlength=n_bins)
    sy = np.bincount(idx, weights=y, minlength=n_bins)
    with np.errstate(invalid="ignore"):
        return {"count": count, "mean_p": sp / count, "freq": sy / count}


def ece(p: np.ndarray, y: np.ndarray, n_bins: int = 10) -> float:
    r = reliability(p, y, n_bins)
    n = r["count"].sum()
    if n == 0:
        return float("nan")
    gap = np.nan_to_num(np.abs(r["mean_p"] - r["freq"]))
    return float(np.sum(r["count"] / n * gap))


class PairLog:
    """(prediction, outcome) pairs in numpy: a ring of the newest ``window`` pairs
    (a daemon: its memory is fixed at start, 9 bytes a pair), or all of them when
    ``window`` is None (replay: grows by doubling), each with its deadline, by which
    replay filters (module doc; a ring is not filtered, so it keeps none)."""

    def __init__(self, window: Optional[int] = None) -> None:
        self.window = window
        cap = int(window) if window else 1024
        # written now (np.full, not empty/zeros): the OS maps untouched pages lazily, and a ring
        # filling up over minutes reads as a growing RSS in a soak, though its size is fixed
        self.p = np.full(cap, 0.0, dtype=np.float64)
        self.y = np.full(cap, 0, dtype=np.uint8)
        self.d = np.zeros(0 if window else cap, dtype=np.float32)
        self.n = 0  # pairs held
        self.head = 0  # ring: next write position

    def extend(self, p: np.ndarray, y: np.ndarray, d: np.ndarray) -> None:
        k = p.size
        if not k:
            return
        if self.window is None:
            if self.n + k > self.p.size:
                cap = max(2 * self.p.size, self.n + k)
                self.p = np.concatenate((self.p[: self.n], np.empty(cap - self.n)))
                self.y = np.concatenate((self.y[: self.n], np.empty(cap - self.n, dtype=np.uint8)))
                self.d = np.concatenate((self.d[: self.n], np.empty(cap - self.n, dtype=np.float32)))
            self.p[self.n: self.n + k], self.y[self.n: self.n + k], self.d[self.n: self.n + k] = p, y, d
            self.n += k
            return
        w = self.window
        # where one pair at a time would have put the last ``w`` of them: a batch leaves the
        # ring as the same pairs one by one do
        start = self.head + max(0, k - w)
        p, y = p[-w:], y[-w:]
        idx = (start + np.arange(p.size)) % w
        self.p[idx], self.y[idx] = p, y
        self.head = int((self.head + k) % w)
        self.n = min(w, self.n + k)

    def arrays(self, closed_by: Optional[float] = None) -> tuple[np.ndarray, np.ndarray]:
        """Predictions and outcomes; with ``closed_by`` (replay only), only pairs whose
        deadline is not after it."""
        p, y = self.p[: self.n], self.y[: self.n]
        if closed_by is not None and self.window is None:
            keep = self.d[: self.n] <= closed_by
            p, y = p[keep], y[keep]
        return p.copy(), y.astype(np.int64)


class CalibrationTracker:
    """Online (prediction, outcome) pairs, resolved per block."""

    def __init__(self, max_blocks: int, n_bins: int = 10, window: Optional[int] = None,
                 recalibrate_period: Optional[int] = None, models: int = 1) -> None:
        self.n_bins = n_bins
        # float32: a probability needs no more, and a deadline in accesses is exact to 2^24 and
        # within 1e-7 of itself beyond (a calibration deadline, not a correctness one): 8 B a block
        self.pred = np.full(max_blocks, np.nan, dtype=np.float32)
        self.deadline = np.zeros(max_blocks, dtype=np.float32)
        # a long-running daemon keeps the newest ``window`` pairs; replay keeps all
        self.pairs = PairLog(window)
        # with a period: the stated probability is recalibrated online (``recalibration``), and
        # per model; each pending prediction keeps its code (model and bin), to count its reuse
        self.recal = Recalibrator(recalibrate_period, models) if recalibrate_period else None
        self.pending_code = np.full(max_blocks if self.recal else 0, UNTRACKED, dtype=np.uint8)

    @property
    def n_scored(self) -> int:
        return self.pairs.n

    def predict(self, block: int, p: float, now: float, horizon: float, model: int = 0) -> None:
        """Score ``model``'s ``p`` = P(``block`` is accessed within ``horizon`` of ``now``)
        (recalibrated where this tracker recalibrates). While an earlier prediction of
        the block is pending it stands and this one is skipped: replacing it would drop
        exactly the predictions whose block was not reused (a block is predicted again
        when it is evicted), biasing the outcomes up."""
        old = self.pred[block]
        if old == old:  # not NaN: pending
            if now <= self.deadline[block]:
                return
            self.pairs.extend(np.array([old]), np.zeros(1, dtype=np.uint8), self.deadline[block: block + 1])  # not reused
        self.deadline[block] = now + horizon
        if self.recal is None:
            self.pred[block] = p
        else:
            self.pending_code[block] = self.recal.track(model, p, float(self.deadline[block]))
            self.pred[block] = self.recal.state(model, p)

    def access(self, block: int, now: float) -> None:
        p = self.pred[block]
        if p == p:  # not NaN: a prediction is pending
            reused = bool(now <= self.deadline[block])
            self.pairs.extend(np.array([p]), np.array([reused], dtype=np.uint8), self.deadline[block: block + 1])
            self.pred[block] = np.nan
            if reused and self.recal is not None:
                self.recal.reuse(int(self.pending_code[block]), float(self.deadline[block]))

    def fold(self, now: int, decay: float) -> None:
        """Once per model refresh: closed windows train the recalibration map (``decay``:
        the weight older evidence keeps per period, the model's own forgetting)."""
        if self.recal is not None:
            self.recal.fold(now, decay)

    def on_freed(self, block: int) -> None:
        """``block`` is gone: its pending prediction is dropped, never scored."""
        if self.recal is not None:
            if self.pred[block] == self.pred[block]:
                self.recal.drop(int(self.pending_code[block]), float(self.deadline[block]))
            self.pending_code[block] = UNTRACKED
        self.pred[block] = np.nan
        self.deadline[block] = 0.0

    def finish(self, now: float) -> None:
        """Resolve pending predictions whose deadline has passed (no reuse)."""
        due = ~np.isnan(self.pred) & (self.deadline < now)
        self.pairs.extend(self.pred[due], np.zeros(int(due.sum()), dtype=np.uint8), self.deadline[due])
        self.pred[due] = np.nan

    def arrays(self, now: Optional[float] = None) -> tuple[np.ndarray, np.ndarray]:
        """Scored pairs; with ``now``, in replay only those whose window has closed by then
        (module doc: a ring is never filtered)."""
        return self.pairs.arrays(now)

    def summary(self, now: Optional[float] = None) -> dict[str, float]:
        p, y = self.arrays(now)
        # the model's own, in this tracker's bins where they split the recalibration's (else 10)
        raw = {"ece_raw": self.recal.raw_ece(self.n_bins if BINS % self.n_bins == 0 else 10)} if self.recal else {}
        return {"brier": brier(p, y), "ece": ece(p, y, self.n_bins), **raw, "n": int(p.size),
                "mean_p": float(p.mean()) if p.size else float("nan"),
                "base_rate": float(y.mean()) if y.size else float("nan")}
