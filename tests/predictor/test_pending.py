"""A refresh's inputs: the censored (not yet reused) accesses per cell and age, and the distinct hazard rows."""

import numpy as np
import pytest

from kvtier.predictor import survival
from kvtier.predictor.cells import N_IRR
from kvtier.predictor.reuse_model import PENDING_SAMPLE, Candidate, ReuseModel

from .test_reuse_model import _cell


def test_the_censored_count_per_cell_is_exact_and_only_its_ages_are_sampled():
    """Every access is reused or is its block's latest: a cell's pending mass is its accesses
    less its reuses, whatever the sample of blocks saw. Scaled from a sample instead, a cell
    whose sample read short kept accesses at risk at distances none had reached."""
    n = 4 * PENDING_SAMPLE
    m = ReuseModel(n, candidates=(Candidate("all", 1.0),), refresh_every=10**9, initial_age=100.0)
    rng = np.random.default_rng(3)
    for b in rng.integers(0, n, size=30_000).tolist():
        m.access(b, cls=b % 3)
    rare = _cell(5, 1)
    m.accesses[rare] += 7.0  # pending accesses of blocks the sample cannot have seen
    pending = m._pending()
    want = np.maximum(m.accesses - m.reuses.sum(axis=1), 0.0)
    assert np.allclose(pending.sum(axis=1), want, rtol=1e-9, atol=1e-9)
    assert pending[rare, 0] == 7.0 and pending[rare, 1:].sum() == 0.0  # censored at entry
    seen = pending.sum(axis=1) > 0
    assert seen.sum() >= 6  # classes 0-2 at stages 1 and 2, at least


def test_a_freed_blocks_latest_access_is_never_reused_not_pending():
    """A block freed before its latest access was reused takes that access out of the
    pending mass (no block carries it: spread over the live blocks' ages, it had made their
    hazards read high) and leaves it at risk at every distance: it will not come back."""
    m = ReuseModel(64, candidates=(Candidate("all", 1.0),), refresh_every=10**6, initial_age=10.0,
                   memory_horizons=1e12)
    for b in range(10):
        m.access(b, cls=0)
    for b in range(3):
        m.access(b, cls=0)  # 3 reused at distance 8-10
    for b in range(3, 10):
        m.reset(b)  # 7 freed, never reused
    first, second = _cell(0, 1), int(m.cell[0])  # blocks 0-2: stage 2, reuse distance 8-10
    assert m.cell[1] == m.cell[2] == second and m.freed[first] == 7.0
    pending = m._pending()
    assert pending[first].sum() == 0.0 and pending[second].sum() == 3.0
    m.refresh()
    at_far_bucket = m._hazard("class_stage_irr", pending, {})[first, 20]
    assert at_far_bucket == pytest.approx(2.0 * m._hazard("class_stage", pending, {})[first // N_IRR, 20] / (2.0 + 7.0))


def test_distinct_rows_groups_equal_rows_and_keeps_rows_whose_keys_collide(monkeypatch):
    a = np.array([[0.1, 0.2], [0.3, 0.4], [0.1, 0.2], [0.3, 0.4], [0.5, 0.0]])
    a = np.pad(a, ((0, 0), (0, survival.N_BUCKETS - 2)))
    distinct, inverse = survival.distinct_rows(a)
    assert distinct.shape[0] == 3 and np.array_equal(distinct[inverse], a)
    monkeypatch.setattr(survival, "_ROW_KEY", np.zeros(survival.N_BUCKETS))  # every key collides
    distinct, inverse = survival.distinct_rows(a)
    assert np.array_equal(distinct, a) and inverse.tolist() == [0, 1, 2, 3, 4]
