"""The value policy's compiled replay loop (kernels/_replay.c) against its Python hooks:
the same hits, counts, shadow caches and calibration pairs, byte for byte."""

import hashlib

import numpy as np
import pytest

from kvtier.policy import make_policy, value_compiled
from kvtier.replay.sim import simulate
from kvtier.replay.synthetic import synthetic_trace
from kvtier.replay.traces import Trace

pytestmark = pytest.mark.skipif(not value_compiled.available(), reason="kernels/_replay.c was not built")


def _state(p) -> str:
    """Every piece of the policy's state a replay writes, as one digest."""
    h = hashlib.sha256()
    m, sh = p.model, p.shadows
    for a in (m.last, m.count, m.cell, m.reuses, m.accesses, m.table3, p.slots[: p.size], p.where, sh.member,
              sh.slots, sh.hits):
        h.update(np.ascontiguousarray(a).tobytes())
    if p.calib is not None:
        c = p.calib
        for a in (c.pred, c.deadline, c.pairs.p[: c.pairs.n], c.pairs.y[: c.pairs.n], c.pairs.d[: c.pairs.n]):
            h.update(a.tobytes())
    h.update(repr((m.clock, m._ev_sum, m._ev_n, m.eviction_age, p.size, p.bypassed, p._pool_at, sh._at, sh.size,
                   p.active, p.stats())).encode())
    return h.hexdigest()


def _counting(p):
    """``p`` with its compiled runner counting the accesses it takes (so a test that
    compares both paths cannot pass with the kernel declining everything)."""
    taken = [0]
    make = p.compiled_replay

    def compiled_replay(blocks, classes, resident):
        run = make(blocks, classes, resident)
        assert run is not None

        def counted(start, stop):
            nxt, hits = run(start, stop)
            taken[0] += nxt - start
            return nxt, hits
        return counted
    p.compiled_replay = compiled_replay
    return taken


@pytest.mark.parametrize("family", ["zipf", "loop", "shifting", "chat", "agent", "scan"])
@pytest.mark.parametrize("fraction", [0.01, 0.1])
def test_compiled_replay_leaves_the_state_of_the_python_hooks(family, fraction):
    tr = synthetic_trace(family, requests=1500)
    cap = max(1, int(round(fraction * tr.n_unique)))
    ref = make_policy("kvtier", cap, tr.n_unique)
    want = simulate(ref, tr, compiled=False)
    fast = make_policy("kvtier", cap, tr.n_unique)
    taken = _counting(fast)
    got = simulate(fast, tr)
    assert got == want
    assert _state(fast) == _state(ref)
    assert fast.calibration() == ref.calibration()
    assert taken[0] > 0.9 * tr.n_accesses  # the kernel took the run, the hooks only its stops


@pytest.mark.parametrize("params", [
    {"samples": 64},  # a cache smaller than the sample: every resident is a candidate, no pool draws
    {"admission": False},
    {"track_calibration": False},
    {"calibration_sample": 1, "refresh_every": 500},  # every block scored: the staging buffer fills
])
def test_compiled_replay_matches_with_other_settings(params):
    tr = synthetic_trace("chat", requests=800)
    cap = 40
    ref = make_policy("kvtier", cap, tr.n_unique, **params)
    fast = make_policy("kvtier", cap, tr.n_unique, **params)
    taken = _counting(fast)
    assert simulate(fast, tr) == simulate(ref, tr, compiled=False)
    assert _state(fast) == _state(ref)
    assert taken[0] > 0.8 * tr.n_accesses


def test_a_weighted_policy_replays_through_its_hooks():
    p = make_policy("kvtier", 10, 100)
    p.set_weights(np.array([1]), np.array([0.5], dtype=np.float32))
    assert p.compiled_replay(np.zeros(5, np.int64), np.zeros(5, np.int64), np.zeros(100, bool)) is None


def _small(blocks) -> Trace:
    b = np.asarray(blocks, dtype=np.int64)
    n = b.size
    return Trace("t", "mooncake", b, np.arange(n, dtype=float), np.zeros(n, np.int64), np.arange(n), n, 8)


def test_an_id_outside_the_policy_is_left_to_the_hooks_which_refuse_it():
    tr = _small([1, 2, 3, 1, 9, 4])
    ref, fast = make_policy("kvtier", 4, 8), make_policy("kvtier", 4, 8)
    taken = _counting(fast)
    for p, compiled in ((ref, False), (fast, True)):
        with pytest.raises(IndexError):
            simulate(p, tr, compiled=compiled)
    assert taken[0] == 4  # the kernel took the four before it and stopped
    assert _state(fast) == _state(ref)


def test_a_corrupt_pool_is_refused_not_read():
    tr = synthetic_trace("zipf", requests=200)
    p = make_policy("kvtier", 20, tr.n_unique)
    resident = np.zeros(tr.n_unique, dtype=bool)
    run = p.compiled_replay(tr.block, tr.cls, resident)
    nxt, _ = run(0, 100)
    assert nxt == 100 and p.size == 20  # full: the next miss draws from the pool
    p._pool[p._pool_at: p._pool_at + p.samples] = 10 ** 9
    with pytest.raises(ValueError, match="pool or slots are corrupt"):
        run(100, tr.n_accesses)
    slots = p.slots.copy()
    assert np.array_equal(np.sort(slots), np.sort(np.flatnonzero(resident)))  # nothing half-moved


def test_past_two_to_the_24_accesses_deadlines_compare_as_numpy_does():
    """A calibration deadline is float32; numpy compares a Python float with it in float32,
    which past 2^24 accesses rounds the clock: the kernel must round it the same way."""
    tr = synthetic_trace("chat", requests=800)
    ref = make_policy("kvtier", 40, tr.n_unique, calibration_sample=1, refresh_every=500)
    fast = make_policy("kvtier", 40, tr.n_unique, calibration_sample=1, refresh_every=500)
    for p in (ref, fast):
        p.model.clock = (1 << 24) + 1  # odd: not a float32
    assert simulate(fast, tr) == simulate(ref, tr, compiled=False)
    assert _state(fast) == _state(ref)


def test_a_policy_over_more_ids_than_the_trace_replays_through_its_hooks():
    tr = _small([1, 2, 3, 1])
    p = make_policy("kvtier", 4, 16)  # resident covers the trace's 8 ids, the policy 16
    assert p.compiled_replay(tr.block, tr.cls, np.zeros(8, dtype=bool)) is None
    assert simulate(p, tr) == 1
