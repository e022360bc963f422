"""Calibration metrics and the pair log behind them."""

import numpy as np
import pytest

from kvtier.predictor.calibration import CalibrationTracker, brier, ece


def _f32(xs: list) -> list:
    return np.asarray(xs, dtype=np.float32).astype(np.float64).tolist()


def test_calibration_metrics():
    p = np.array([0.1, 0.1, 0.9, 0.9])
    y = np.array([0, 0, 1, 1])
    assert brier(p, y) == pytest.approx(0.01)
    assert ece(p, y) == pytest.approx(0.1)
    t = CalibrationTracker(3)
    t.predict(0, 0.8, now=0.0, horizon=5.0)
    t.predict(1, 0.3, now=0.0, horizon=5.0)
    t.access(0, 3.0)  # within horizon: outcome 1
    t.finish(10.0)  # block 1 never came back: outcome 0
    p, y = t.arrays()
    assert p.tolist() == _f32([0.8, 0.3]) and y.tolist() == [1, 0]  # predictions are kept as float32


def test_calibration_pairs_keep_the_newest_window_in_fixed_memory():
    t = CalibrationTracker(max_blocks=4, window=5)
    for i in range(12):  # 12 resolved predictions, p = i / 100, outcome = i odd
        t.predict(0, i / 100, now=float(i), horizon=0.5 if i % 2 else -1.0)
        t.access(0, now=float(i))
    p, y = t.arrays()
    assert sorted(p.tolist()) == _f32([0.07, 0.08, 0.09, 0.10, 0.11]) and t.n_scored == 5
    assert dict(zip(p.tolist(), y.tolist())) == dict(zip(_f32([0.07, 0.08, 0.09, 0.10, 0.11]), [1, 0, 1, 0, 1]))
    nbytes = t.pairs.p.nbytes + t.pairs.y.nbytes + t.pairs.d.nbytes
    for _ in range(1000):
        t.predict(1, 0.5, now=0.0, horizon=1.0)
        t.access(1, now=0.5)
    assert t.pairs.p.nbytes + t.pairs.y.nbytes + t.pairs.d.nbytes == nbytes  # a ring: nothing grows
    u = CalibrationTracker(max_blocks=2)  # replay: every pair kept
    for _ in range(3000):
        u.predict(0, 0.25, now=0.0, horizon=1.0)
        u.access(0, now=2.0)
    assert u.n_scored == 3000 and u.arrays()[1].sum() == 0


def test_a_pair_counts_once_its_window_has_closed_not_when_it_resolved():
    """A reuse resolves a prediction at once, a miss only at its deadline: scoring pairs
    as they resolve would count, at any moment, the reuses of the windows still open and
    none of their misses. With ``now``, only closed windows count."""
    t = CalibrationTracker(4)
    t.predict(0, 0.9, now=0.0, horizon=100.0)
    t.access(0, 5.0)  # reused early: outcome 1, but its window is open until 100
    t.predict(1, 0.2, now=0.0, horizon=5.0)
    t.predict(2, 0.7, now=0.0, horizon=100.0)  # still pending at 10: unknown, not scored
    t.finish(10.0)  # block 1's window closed without a reuse: outcome 0
    p, y = t.arrays(now=10.0)
    assert p.tolist() == _f32([0.2]) and y.tolist() == [0]
    assert t.summary(now=10.0)["n"] == 1
    assert sorted(t.arrays()[1].tolist()) == [0, 1]  # without ``now``: every resolved pair
    t.finish(200.0)  # block 2's window closed too
    p, y = t.arrays(now=200.0)
    assert dict(zip(p.tolist(), y.tolist())) == dict(zip(_f32([0.9, 0.2, 0.7]), [1, 0, 0]))


def test_a_daemon_ring_is_not_filtered_by_deadline():
    """In a ring, reuses resolve (and enter) early and misses at their deadline: filtering
    by deadline would keep the misses and drop reuses the ring had already overwritten.
    Here the ring's newest pairs are reuses whose windows are still open: they count."""
    u = CalibrationTracker(max_blocks=64, window=8)
    for i in range(32):  # long windows, all resolved early as reuses, none closed yet
        u.predict(i, 0.5, now=float(i), horizon=1e6)
        u.access(i, now=float(i) + 0.5)
    assert u.summary(now=40.0)["n"] == 8 and u.summary(now=40.0)["base_rate"] == 1.0
