import numpy as np
import pytest

from kvtier.predictor.beta import BetaReuseModel, expected_epochs_to_reuse, forget, p_reuse_within
from kvtier.predictor.calibration import CalibrationTracker, brier, ece
from kvtier.predictor.priors import ClassPriors


def test_closed_form_forgetting_equals_stepwise():
    lam = 0.97
    a, b = np.array([2.5, 0.1]), np.array([7.0, 30.0])
    sa, sb = a.copy(), b.copy()
    for _ in range(37):  # one idle epoch = one discounted failure
        sa, sb = lam * sa, lam * sb + 1.0
    ca, cb = forget(a, b, np.array([37, 37]), lam)
    assert np.allclose(ca, sa, rtol=1e-12) and np.allclose(cb, sb, rtol=1e-12)


def test_horizon_probability_matches_monte_carlo():
    rng = np.random.default_rng(0)
    for a, b, h in ((0.3, 20.0, 50), (2.0, 5.0, 3), (0.05, 1.0, 400)):
        theta = rng.beta(a, b, 400_000)
        mc = 1 - np.mean((1 - theta) ** h)
        assert abs(p_reuse_within(a, b, h) - mc) < 0.004


def test_expected_time_and_model_updates():
    assert expected_epochs_to_reuse(np.array([3.0]), np.array([4.0]))[0] == pytest.approx(3.0)
    n = 3
    m = BetaReuseModel(np.zeros(n), np.zeros(n), np.zeros(n), epoch_s=2.0, forgetting=0.9)
    m.init(np.arange(n), 1.0, 1.0, now_s=0.0)
    m.observe_access(np.array([0]), now_s=4.0)  # two idle epochs, then a success
    a, b = forget(np.array([1.0]), np.array([1.0]), np.array([2.0]), 0.9)
    assert m.alpha[0] == pytest.approx(a[0] + 1) and m.beta[0] == pytest.approx(b[0])
    # a fresh access makes reuse likelier than staying idle
    assert m.p_reuse(0, 4.0, 10) > m.p_reuse(1, 4.0, 10)
    with pytest.raises(ValueError):
        BetaReuseModel(np.zeros(1), np.zeros(1), np.zeros(1), forgetting=1.0)


def test_priors_recover_known_class_parameters():
    rng = np.random.default_rng(1)
    pri = ClassPriors(2, 40_000, window_epochs=512, refit_every=10**9, shrink=1.0)
    truth = {0: (0.3, 20.0), 1: (2.0, 8.0)}
    block = 0
    for c, (a, b) in truth.items():
        theta = rng.beta(a, b, 15_000)
        gaps = rng.geometric(np.maximum(theta, 1e-12))  # epochs until next access
        for g in gaps:
            pri.event(block, c, 0.0)
            if g < 512:
                pri.event(block, c, float(g))  # resolves the gap; leaves a new open one
                pri.pending[block] = False
            block += 1
    pri.advance(10_000.0)
    pri.refit()
    for c, (a, b) in truth.items():
        for h in (1, 10, 100):
            assert abs(p_reuse_within(pri.alpha[c], pri.beta[c], h) - p_reuse_within(a, b, h)) < 0.03


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
    assert p.tolist() == [0.8, 0.3] and y.tolist() == [1, 0]


def test_class_prior_births_stay_bounded_by_blocks_not_accesses():
    """One block accessed over and over must not grow the birth queue (the daemon's RSS grew so)."""
    pri = ClassPriors(n_classes=2, max_blocks=16, window_epochs=1e6)
    for i in range(20_000):
        pri.event(i % 16, i % 2, float(i))
    assert len(pri._births) <= 2 * 16 + 1024
    pri.advance(1e6 + 20_000)  # every gap resolves as "no reuse", exactly once per pending block
    assert not pri.pending.any() and pri.hist[:, -1].sum() == 16


def test_calibration_pairs_keep_the_newest_window_in_fixed_memory():
    t = CalibrationTracker(max_blocks=4, window=5)
    for i in range(12):  # 12 resolved predictions, p = i / 100, outcome = i odd
        t.predict(0, i / 100, now=float(i), horizon=0.5 if i % 2 else -1.0)
        t.access(0, now=float(i))
    p, y = t.arrays()
    assert sorted(p.tolist()) == [0.07, 0.08, 0.09, 0.10, 0.11] and t.n_scored == 5
    assert dict(zip(p.tolist(), y.tolist())) == {0.07: 1, 0.08: 0, 0.09: 1, 0.10: 0, 0.11: 1}
    nbytes = t.pairs.p.nbytes + t.pairs.y.nbytes
    for _ in range(1000):
        t.predict(1, 0.5, now=0.0, horizon=1.0)
        t.access(1, now=0.5)
    assert t.pairs.p.nbytes + t.pairs.y.nbytes == nbytes  # a ring: nothing grows
    u = CalibrationTracker(max_blocks=2)  # replay: every pair kept
    for _ in range(3000):
        u.predict(0, 0.25, now=0.0, horizon=1.0)
        u.access(0, now=2.0)
    assert u.n_scored == 3000 and u.arrays()[1].sum() == 0
