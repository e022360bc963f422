"""The kvtier hit-density policy: exact victims, learned ordering, admission."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.policy import make_policy
from kvtier.predictor.classes import N_STAGES
from kvtier.replay.sim import simulate

from ..replay.test_replay import _evictions, _trace


def test_before_any_evidence_the_oldest_goes():
    # all residents are candidates (samples >= capacity) and the prior density falls with age
    seq = [0, 1, 2, 0, 3, 1, 4, 0, 2]
    assert _evictions("kvtier", seq, 3) == [1, 2, 0, 3, 1]


def _learned(policy, good: int, bad: int):
    """Class ``good`` was hit at age 10; class ``bad`` was only ever evicted (also at 10)."""
    policy.hits[good, 10] = 500
    policy.evictions[good, 10] = 100
    policy.evictions[bad, 10] = 600
    policy._reconfigure()
    return policy


def test_learned_density_ranks_hit_classes_above_evicted_ones():
    pol = _learned(make_policy("kvtier", 4, 16, track_calibration=False), good=1, bad=2)
    assert pol.density[1, 0] > pol.density[2, 0]
    assert pol.density[1, 0] > pol.density[1, 11] == 0  # past the age where hits came, value falls
    for b, k in zip(range(4), (1, 2, 1, 1)):
        pol.observe(b, float(b), 0)
        pol.insert(b, float(b), 0, -1)
        pol.klass[b] = k
        pol.klass_row[b] = k * pol.A
    assert pol.evict(4.0) == 1  # the only block of the never-hit class, though not the oldest


def test_admission_rejects_a_block_worth_less_than_its_victim():
    pol = make_policy("kvtier", 2, 64, track_calibration=False, explore_every=1 << 30)
    good, bad = 0 * N_STAGES, 1 * N_STAGES  # first-access classes of feature classes 0 and 1
    _learned(pol, good=good, bad=bad)
    for b, cls in ((0, 0), (1, 1)):  # one resident of each class; the victim is the "bad" one
        pol.observe(b, 0.0, cls)
        pol.insert(b, 0.0, cls, -1)
    pol.observe(5, 1.0, 1)  # a first access of feature class 1: only ever evicted so far
    size = pol.size
    assert pol.admit(5, 1.0, 1, -1) is False and pol.size == size and pol.bypassed == 1
    pol.observe(6, 1.0, 0)  # a block of the class that gets hits displaces it
    assert pol.admit(6, 1.0, 0, -1) is True
    assert pol.evict(1.0) == 1


def test_random_traces_keep_the_resident_set_consistent():
    rng = np.random.default_rng(0)
    seq = rng.zipf(1.3, 5000) % 300
    tr = _trace(seq.tolist())
    pol = make_policy("kvtier", 40, tr.n_unique, track_calibration=False)
    hits = simulate(pol, tr, None)
    assert 0 < hits < tr.n_accesses
    resident = pol.slots[: pol.size]
    assert np.unique(resident).size == pol.size <= 40
    assert np.all(pol.where[resident] == np.arange(pol.size))


def test_bad_parameters_are_rejected():
    with pytest.raises(ValueError):
        make_policy("kvtier", 4, 16, samples=0)


def test_sparse_cells_are_shrunk_towards_the_pooled_density():
    """One eviction is no evidence that a class is worthless: a cell with few events
    keeps most of the pooled density at its age, while a well-observed cell keeps its own.
    (Victims are the minimum over noisy estimates; unshrunk sparse cells would win it.)"""
    pol = _learned(make_policy("kvtier", 4, 16, track_calibration=False, shrink_events=30.0), good=1, bad=2)
    pol.evictions[3, 10] = 1  # class 3: a single eviction, no hits
    pol._reconfigure()
    pooled = pol.density[0, 10]  # class 0 has no events at all: exactly the pooled density
    assert pooled > 0
    assert pol.density[3, 10] == pytest.approx(pooled * 30 / 31)  # mostly pooled
    assert pol.density[2, 10] < 0.1 * pooled  # 600 evictions: its own (near-zero) density
    assert pol.density[2, 10] < pol.density[3, 10] < pol.density[1, 10]
