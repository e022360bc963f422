"""Online recalibration of the stated reuse probabilities (predictor/recalibration.py)."""

import numpy as np
import pytest

from kvtier.policy import make_policy
from kvtier.predictor.calibration import CalibrationTracker
from kvtier.predictor.recalibration import (
    BINS,
    PSEUDO_COUNT,
    RING,
    UNTRACKED,
    Recalibrator,
    bin_of,
    pool_adjacent_violators,
)
from kvtier.replay.sim import simulate
from kvtier.replay.synthetic import synthetic_trace

PERIOD = 100


def test_a_bin_states_the_reuse_rate_its_closed_predictions_had():
    r = Recalibrator(PERIOD)
    codes = [r.track(0, 0.4, 150.0) for _ in range(20)]  # deadline in period 1
    assert codes == [bin_of(0.4)] * 20 == [8] * 20
    for c in codes[:4]:  # 4 of 20 reused
        r.reuse(c, 150.0)
    p = float(np.float32(0.4))
    r.fold(200, 1.0)  # closes periods 0 and 1
    want = (4 + PSEUDO_COUNT * p) / (20 + PSEUDO_COUNT)
    assert r.state(0, 0.4) == pytest.approx(want, rel=1e-6)
    assert r.state(0, 0.42) == r.state(0, 0.4)  # the same bin
    assert r.state(0, 0.9) == pytest.approx(0.9)  # no evidence: the model's own


def test_evidence_waits_until_its_window_has_closed():
    """A reuse is known early, a miss only at the deadline: counted before the period
    closed, the early reuses alone would pull every bin up."""
    r = Recalibrator(PERIOD)
    c = r.track(0, 0.1, 350.0)  # period 3
    r.reuse(c, 350.0)
    r.fold(300, 1.0)  # closes periods 0..2 only
    assert (r.floor == 0).all() and (r.ceiling == 1).all() and r.n.sum() == 0
    assert r.state(0, 0.1) == pytest.approx(0.1)
    r.fold(400, 1.0)
    assert r.n[bin_of(0.1)] == 1 and r.sum_y[bin_of(0.1)] == 1


def test_older_periods_weigh_less():
    r = Recalibrator(PERIOD)
    for deadline, reused in ((50.0, True), (150.0, False)):
        c = r.track(0, 0.5, deadline)
        if reused:
            r.reuse(c, deadline)
    r.fold(200, 0.5)  # period 0 folds, decays once; period 1 folds
    b = bin_of(0.5)
    assert r.n[b] == 1.5 and r.sum_y[b] == 0.5
    assert r.all_n[b] == 2 and r.all_y[b] == 1  # the raw totals do not decay


def test_models_keep_their_own_maps():
    r = Recalibrator(PERIOD, models=3)
    for _ in range(10):
        r.reuse(r.track(2, 0.3, 10.0), 10.0)  # model 2: always reused
        r.track(0, 0.3, 10.0)  # model 0: never
    r.fold(100, 1.0)
    assert r.state(2, 0.3) > 0.7 and r.state(0, 0.3) < 0.1
    assert r.state(1, 0.3) == pytest.approx(0.3)


def test_predictions_outside_the_ring_or_nan_are_not_tracked():
    r = Recalibrator(PERIOD)
    before = (r.due_n.copy(), r.due_p.copy())
    assert r.track(0, 0.5, float(RING * PERIOD)) == UNTRACKED  # period RING: past the ring
    assert r.track(0, float("nan"), 10.0) == UNTRACKED
    r.reuse(UNTRACKED, 10.0)
    assert np.array_equal(r.due_n, before[0]) and np.array_equal(r.due_p, before[1]) and not r.reused.any()
    assert np.isnan(r.state(0, float("nan")))
    r.fold(2 * PERIOD, 1.0)
    assert r.track(0, 0.5, 150.0) == UNTRACKED  # period 1 is closed: too late to count


def test_the_map_never_states_less_for_a_higher_model_probability():
    rng = np.random.default_rng(0)
    r = Recalibrator(PERIOD)
    for _ in range(3000):
        p, deadline = float(rng.random()), float(rng.integers(0, 5 * PERIOD))
        c = r.track(0, p, deadline)
        if rng.random() < 1 - p:  # anti-calibrated: the higher, the rarer
            r.reuse(c, deadline)
    r.fold(5 * PERIOD, 0.9)
    assert (r.n > 0).sum() > BINS // 2
    stated = [r.state(0, p) for p in np.linspace(-0.1, 1.1, 2001)]
    assert np.all(np.diff(stated) >= 0)


def test_a_bin_without_evidence_stays_between_its_neighbours():
    r = Recalibrator(PERIOD)
    for _ in range(20):
        r.reuse(r.track(0, 0.05, 10.0), 10.0)  # bin 1: always reused
    r.fold(PERIOD, 1.0)
    assert r.state(0, 0.05) == pytest.approx(float(np.float32((20 + PSEUDO_COUNT * np.float32(0.05)) / 24)))
    assert r.state(0, 0.5) == r.state(0, 0.05)  # no evidence above: not below bin 1's value ...
    assert r.state(0, 0.99) == pytest.approx(0.99)  # ... and the model's own above it
    assert r.state(0, 0.01) == pytest.approx(0.01)  # no bin below: the model's own, up to bin 1's


def test_a_freed_blocks_prediction_leaves_the_counts_as_it_leaves_the_pairs():
    t = CalibrationTracker(10, recalibrate_period=PERIOD)
    t.predict(3, 0.5, 0.0, 50.0)
    t.on_freed(3)
    t.fold(PERIOD, 1.0)
    assert t.recal.n.sum() == 0 and t.pairs.n == 0 and t.pending_code[3] == UNTRACKED
    assert t.recal.state(0, 0.5) == pytest.approx(0.5)


def test_untracked_predictions_are_counted():
    r = Recalibrator(PERIOD)
    r.track(0, 0.5, float(RING * PERIOD) + 1.0)
    r.track(0, float("inf"), 10.0)
    r.track(0, 0.5, float("inf"))
    assert r.untracked == 2 and r.due_n[0, BINS - 1] == 1.0  # p = inf clamps to the top bin


def test_pool_adjacent_violators():
    assert pool_adjacent_violators(np.array([3.0, 1.0, 2.0]), np.ones(3)).tolist() == [2.0, 2.0, 2.0]
    assert pool_adjacent_violators(np.array([1.0, 3.0, 2.0]), np.array([1.0, 1.0, 3.0])).tolist() == \
        [1.0, 2.25, 2.25]
    rng = np.random.default_rng(1)
    y, w = rng.random(50), rng.random(50) + 0.1
    fit = pool_adjacent_violators(y, w)
    assert np.all(np.diff(fit) >= -1e-12) and (fit * w).sum() == pytest.approx((y * w).sum())


def test_raw_ece_is_the_models_own():
    r = Recalibrator(PERIOD)
    for p, reused in ((0.05, True), (0.05, False), (0.95, True), (0.95, True)):
        c = r.track(0, p, 10.0)
        if reused:
            r.reuse(c, 10.0)
    r.fold(PERIOD, 1.0)
    p05, p95 = float(np.float32(0.05)), float(np.float32(0.95))
    assert r.raw_ece() == pytest.approx((abs(2 * p05 - 1) + abs(2 * p95 - 2)) / 4)


def test_the_tracker_states_recalibrated_probabilities_and_reports_both():
    t = CalibrationTracker(10, recalibrate_period=PERIOD)
    for b in range(5):
        t.predict(b, 0.8, 0.0, 50.0)  # none reused
    t.fold(PERIOD, 1.0)
    t.predict(6, 0.8, 100.0, 50.0)
    assert t.pred[6] == pytest.approx((0 + PSEUDO_COUNT * float(np.float32(0.8))) / (5 + PSEUDO_COUNT))
    t.access(6, 120.0)
    t.finish(1000.0)
    s = t.summary(1000.0)
    assert s["ece_raw"] == pytest.approx(float(np.float32(0.8)))
    assert s["n"] == 6


def test_recalibration_states_probabilities_and_changes_no_decision():
    tr = synthetic_trace("zipf", requests=3000)
    cap = max(1, tr.n_unique // 20)
    on, off = (make_policy("kvtier", cap, tr.n_unique, recalibrate=r) for r in (True, False))
    assert simulate(on, tr) == simulate(off, tr)
    assert on.bypassed == off.bypassed and on.stats() == off.stats()
    c_on, c_off = on.calibration(), off.calibration()
    assert c_on["n"] == c_off["n"] and c_on["ece_raw"] == pytest.approx(c_off["ece"], abs=0.02)
    assert c_on["ece"] != c_off["ece"] and "ece_raw" not in c_off
    assert on.calib.recal.folded == on.model.clock // on.model.refresh_every
