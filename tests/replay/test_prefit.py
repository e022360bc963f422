"""``kvtier-prefit``, the hindsight reference: its model reads the whole trace's evidence
from the first refresh, the kernel and the hooks agree on it, and nothing online takes it."""

from __future__ import annotations

import numpy as np
import pytest

import kvtier.policy.value_compiled as value_compiled
from kvtier.policy import make_policy
from kvtier.policy.prefit import NO_FORGETTING
from kvtier.policy.value import ValuePolicy
from kvtier.predictor.cells import N_CELLS, PARTITIONS
from kvtier.predictor.reuse_model import ReuseModel
from kvtier.predictor.survival import N_BUCKETS
from kvtier.replay.sim import run_one, simulate
from kvtier.replay.synthetic import synthetic_trace


def test_preloaded_evidence_is_read_as_counts():
    """A model given evidence by ``preload`` computes the hazards a model holding the same
    counts and censored accesses computes, for every partition."""
    rng = np.random.default_rng(3)
    reuses = rng.integers(0, 20, (N_CELLS, N_BUCKETS)).astype(float)
    censored = rng.integers(0, 20, (N_CELLS, N_BUCKETS)).astype(float)
    accesses = reuses.sum(1) + censored.sum(1) + rng.integers(0, 9, N_CELLS)
    pre, held = ReuseModel(16), ReuseModel(16)
    pre.preload(reuses, accesses, censored)
    held.reuses[:], held.accesses[:] = reuses, accesses
    none = np.zeros((N_CELLS, N_BUCKETS))
    for name in PARTITIONS:
        assert np.array_equal(pre._hazard(name, none, {}), held._hazard(name, censored, {})), name
    fresh = ReuseModel(16)
    assert not np.array_equal(fresh._hazard("class_stage_irr", none, {}), held._hazard("class_stage_irr", censored, {}))
    with pytest.raises(ValueError, match="shapes"):
        pre.preload(reuses[:, :3], accesses, censored)


def test_prefit_knows_the_whole_trace_and_the_kernel_agrees():
    trace = synthetic_trace("loop", requests=5000)  # three passes over the loop
    cap = trace.n_unique // 10
    seen: list[int] = []
    r = run_one("kvtier-prefit", cap, trace, trace.next_use(), {}, seen.append)
    assert sum(seen) == 2 * trace.n_accesses  # both passes show as progress
    assert r.calibration is None and 0 < r.hits < trace.n_accesses
    hits = {}
    for compiled in (True, False):
        pol = make_policy("kvtier-prefit", cap, trace.n_unique)
        pol.prepare(trace.block, trace.cls)
        reuses, accesses, censored = pol.model._known
        # every access is in the evidence: reused, or pending at the end (the first pass frees none)
        assert accesses.sum() == pytest.approx(trace.n_accesses)
        assert reuses.sum() + censored.sum() == pytest.approx(trace.n_accesses, rel=0.05)
        # the evidence is the access stream's, whatever a cache kept: a replay's model gathers the same
        if compiled:
            replayed = ValuePolicy(cap, trace.n_unique, memory_horizons=NO_FORGETTING, track_calibration=False)
            simulate(replayed, trace)
            for mine, theirs in zip(pol.model._known, replayed.model.evidence()):
                assert np.allclose(mine, theirs, rtol=1e-6)
        # the tables are built from it before the first access
        assert pol.model.refreshes == 1 and pol.model.clock == 0
        if compiled and value_compiled.available():
            assert pol.compiled_replay(trace.block, trace.cls, np.zeros(trace.n_unique, bool)) is not None
        hits[compiled] = simulate(pol, trace, trace.next_use(), compiled=compiled)
    assert hits[True] == hits[False] == r.hits
    # the same policy without the evidence (no forgetting either) decides otherwise, and so
    # does one that had the evidence for its first tables only: every refresh reads it
    bare = ValuePolicy(cap, trace.n_unique, memory_horizons=NO_FORGETTING, track_calibration=False)
    assert hits[True] != simulate(bare, trace)
    once = make_policy("kvtier-prefit", cap, trace.n_unique)
    once.prepare(trace.block, trace.cls)
    once.model._known = None
    assert hits[True] != simulate(once, trace, trace.next_use())


def test_evidence_counts_a_freed_access_once():
    m = ReuseModel(8, refresh_every=1000)
    for b in (1, 2, 1):
        m.access(b, 0)
    m.reset(2)  # freed before a reuse: never reused, not pending
    reuses, accesses, censored = m.evidence()
    assert accesses.sum() == 3 and reuses.sum() == 1 and censored.sum() == pytest.approx(1.0)


def test_prefit_runs_only_prepared_and_only_in_replay():
    from kvtier.daemon.config import load_config

    trace = synthetic_trace("loop", requests=200)
    for compiled in (True, False):  # refused on either path, before anything is replayed
        with pytest.raises(ValueError, match="prepare"):
            simulate(make_policy("kvtier-prefit", 8, trace.n_unique), trace, trace.next_use(), compiled=compiled)
    with pytest.raises(Exception, match="replay"):
        load_config(environ={}, overrides=['policy.name="kvtier-prefit"'])


def test_replay_gives_prefit_the_policy_config_kvtier_gets():
    from kvtier.cli.replay import _params

    params = _params(None, ["kvtier", "kvtier-prefit", "arc"])
    assert params["kvtier-prefit"] == params["kvtier"] != {} and params["arc"] == {}
