"""The policy contract over every registered policy: randomized invariants, a pure
victim query, and a freed id that starts afresh."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from kvtier.policy import POLICIES, make_policy
from kvtier.policy.base import NEVER

from ..replay.test_replay import _trace

FAST = {"track_calibration": False}  # the predictor is checked separately (test_on_freed_*)


def _arrays(obj, prefix="", seen=None) -> dict[str, bytes]:
    """Every numpy array reachable from ``obj``'s attributes (policy, predictor, lists...)."""
    seen = set() if seen is None else seen
    out: dict[str, bytes] = {}
    if id(obj) in seen:
        return out
    seen.add(id(obj))
    for k, v in vars(obj).items():
        if isinstance(v, np.ndarray):
            out[prefix + k] = v.tobytes() + str(v.dtype).encode()
        elif isinstance(v, np.random.Generator):
            out[prefix + k] = repr(v.bit_generator.state).encode()
        elif isinstance(v, (list, dict)) and k in ("heap", "_nr_heap", "_births"):
            out[prefix + k] = repr(v).encode()
        elif hasattr(v, "__dict__") and type(v).__module__.startswith("kvtier"):
            out.update(_arrays(v, prefix + k + ".", seen))
    return out


def _scalars(pol) -> dict:
    return {k: v for k, v in vars(pol).items() if isinstance(v, (int, float, bool))}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_random_traces_keep_every_policy_consistent(name):
    """size <= capacity, victims were resident, a hit is exactly a resident block, also with
    blocks the mechanism removes now and then; every victim query is pure and returns eligible
    residents only."""
    rng = np.random.default_rng(7)
    seq = (rng.zipf(1.3, 1500) % 120).tolist()
    tr = _trace(seq)
    nxt = tr.next_use()
    cap = 12
    pol = make_policy(name, cap, tr.n_unique, **FAST)
    resident: set[int] = set()
    hits = 0
    for i, b in enumerate(tr.block.tolist()):
        nu = int(nxt[i]) if pol.offline else -1
        pol.observe(b, float(i), 0)
        if b in resident:
            hits += 1
            pol.on_hit(b, float(i), 0, nu)
        elif pol.admit(b, float(i), 0, nu):
            if pol.size >= cap:
                v = pol.evict(float(i))
                assert v in resident, (name, i, v)
                resident.discard(v)
            pol.insert(b, float(i), 0, nu)
            resident.add(b)
        if resident and rng.random() < 0.05:  # the mechanism drops a block (a promotion, a failed write)
            gone = int(rng.choice(sorted(resident)))
            pol.remove(gone)
            resident.discard(gone)
        assert pol.size == len(resident) <= cap
        if i % 97 == 0 and not pol.offline:
            mask = rng.random(tr.n_unique) < 0.6
            before, sc = _arrays(pol), _scalars(pol)
            vs = pol.victims(4, lambda bs: mask[bs])
            assert _arrays(pol) == before and _scalars(pol) == sc, name  # byte-identical
            assert len(vs) <= 4 and len(set(vs.tolist())) == len(vs)
            assert set(vs.tolist()) <= resident and mask[vs].all()
    assert 0 < hits < len(seq)


LIST_POLICIES = ["lru", "s3fifo", "sieve", "arc", "2q", "lirs", "gdsf", "w-tinylfu"]


@pytest.mark.parametrize("name", LIST_POLICIES)
def test_victims_without_a_filter_are_the_next_evictions(name):
    rng = np.random.default_rng(3)
    tr = _trace((rng.zipf(1.2, 800) % 90).tolist())
    pol = make_policy(name, 10, tr.n_unique)
    resident: set[int] = set()
    for i, b in enumerate(tr.block.tolist()):
        pol.observe(b, float(i), 0)
        if b in resident:
            pol.on_hit(b, float(i), 0, -1)
            continue
        if pol.size >= 10:
            resident.discard(pol.evict(float(i)))
        pol.insert(b, float(i), 0, -1)
        resident.add(b)
    shadow = copy.deepcopy(pol)
    assert pol.victims(5).tolist() == [shadow.evict(0.0) for _ in range(5)]


@pytest.mark.parametrize("name", ["lru", "s3fifo"])
def test_skipped_blocks_keep_their_place(name):
    """The daemon's loop: query with some blocks pinned, evict what it returned through
    ``on_evict``; the pinned blocks are neither evicted nor moved."""
    pol = make_policy(name, 6, 32)
    for b in range(6):
        pol.observe(b, 0.0, 0)
        pol.insert(b, 0.0, 0, -1)
    pol.observe(4, 1.0, 0)
    pol.on_hit(4, 1.0, 0, -1)  # s3fifo: 4 earns promotion to main; lru: 4 is most recent
    pinned = np.zeros(32, dtype=bool)
    pinned[[0, 2]] = True
    vs = pol.victims(3, lambda bs: ~pinned[bs])
    for v in vs.tolist():
        pol.on_evict(v, 2.0)
    assert vs.tolist() == [1, 3, 5] and pol.size == 3
    assert pol.victims(3).tolist() == [0, 2, 4]  # pinned 0 and 2 still at the front, 4 behind them


@pytest.mark.parametrize("name", ["kvtier"])
def test_importance_weights_change_the_victim(name):
    pol = make_policy(name, 4, 16, track_calibration=False, samples=16)
    for b in range(4):  # one feature class each
        pol.observe(b, float(b), b)
        pol.insert(b, float(b), b, -1)
    assert pol.victims(1).tolist() == [0]  # equal weights and priors: the oldest
    pol.set_weights(np.array([0, 3]), np.array([1.0, 0.01]))
    assert pol.victims(1).tolist() == [3]  # the newest block, worth little, goes first
    assert pol.victims(4)[0] == 3


@pytest.mark.parametrize("name", ["kvtier"])
def test_on_freed_resets_every_per_block_entry(name):
    """A recycled id must look like one never used: no weight, no history, no open
    gap in the prior fit and no pending prediction to be scored as a reuse."""
    n = 16
    fresh = make_policy(name, 4, n, calibration_sample=1)
    pol = make_policy(name, 4, n, calibration_sample=1)
    for t, b in enumerate([5, 6, 5, 7, 5]):
        pol.observe(b, float(t), 2)
        if b == 5 and t == 0 or b != 5:
            pol.insert(b, float(t), 2, -1)
        else:
            pol.on_hit(b, float(t), 2, -1)
    pol.set_weights(np.array([5]), np.array([0.3]))
    pol.remove(5)
    pol.on_freed(5)
    pf, pp = _arrays(fresh), _arrays(pol)
    for key in pf:
        arr_f = getattr_path(fresh, key)
        if isinstance(arr_f, np.ndarray) and arr_f.ndim == 1 and arr_f.shape[0] == n:
            arr_p = getattr_path(pol, key)
            assert np.array_equal(arr_p[5], arr_f[5], equal_nan=True), key
    scored = pol.calib.n_scored if pol.calib is not None else 0
    gaps = pol.model.reuses.sum()
    pol.observe(5, 10.0, 2)  # the id's next owner: a first access, not a reuse
    if pol.calib is not None:
        assert pol.calib.n_scored == scored
    assert pol.model.reuses.sum() == gaps  # and no reuse counted in the model either
    assert pp  # the walk found arrays


def getattr_path(obj, path: str):
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def test_offline_victims_are_refused_by_the_daemon_config():
    from kvtier.daemon.config import load_config

    for name in ("arc", "belady"):
        with pytest.raises(Exception, match="replay"):
            load_config(environ={}, overrides=[f'policy.name="{name}"'])
    assert NEVER > 0
