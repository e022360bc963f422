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
        for a in (c.pred, c.deadline, c.pairs.p[: c.pairs.n], c.pairs.y[: c.pairs.n], c.pairs.d[: c.pairs.n],
                  c.pending_code):
            h.update(a.tobytes())
        if c.recal is not None:
            r = c.recal
            for a in (r.due_n, r.due_p, r.reused, r.n, r.sum_p, r.sum_y, r.all_n, r.all_p, r.all_y, r.floor,
                      r.ceiling):
                h.update(a.tobytes())
            h.update(repr((r.folded, r.untracked)).encode())
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
    {"evidence_floor": 0.0},
    {"evidence_floor": 0.5},  # the floor decides many admissions
    {"default_candidate": 6, "evidence_floor": 0.5, "refresh_every": 500},  # a density model: P is not the value
    {"admission": False},
    {"track_calibration": False},
    {"recalibrate": False},
    {"calibration_sample": 1, "refresh_every": 500},  # every block scored: the staging buffer fills
    {"calibration_sample": 1, "refresh_every": 500, "calibration_window": 50},
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


def _both(tr, cap, prepare=None, **params):
    """Replay ``tr`` through the hooks and through the kernel: (result or error, state) each."""
    out = []
    for compiled in (False, True):
        p = make_policy("kvtier", cap, tr.n_unique, **params)
        if prepare is not None:
            prepare(p)
        try:
            got = simulate(p, tr, compiled=compiled)
        except Exception as e:  # noqa: BLE001 - the two paths must fail alike
            got = type(e)
        out.append((got, _state(p)))
    return out


def test_a_corrupt_pool_is_left_to_the_hooks():
    """The kernel checks every index an access may touch before it writes anything, and
    leaves an access it cannot check to the hooks (which raise here): nothing out of bounds."""
    tr = synthetic_trace("zipf", requests=200)

    def corrupt(p):
        p._pool[:] = 10 ** 9
    (want, ref), (got, fast) = _both(tr, 20, corrupt)
    assert want is IndexError and got is IndexError and fast == ref


def test_a_replay_continues_a_policy_that_already_holds_blocks():
    """simulate seeds its residency from the policy (a second replay, or hooks before it):
    a held block is a hit, not inserted twice (which had the kernel write slots[-1])."""
    first, second = _small([5, 6]), _small([5, 1, 2, 3, 5, 6, 7, 1, 2])
    hits = []
    for compiled in (False, True):
        p = make_policy("kvtier", 2, 8)
        simulate(p, first, compiled=compiled)
        hits.append(simulate(p, second, compiled=compiled))
        assert sorted(p.slots[: p.size].tolist()) == sorted(np.flatnonzero(p.where >= 0).tolist())
        assert len(set(p.slots[: p.size].tolist())) == p.size
    assert hits[0] == hits[1] and hits[0] >= 1  # block 5 was held: its first access hits
    lru = make_policy("lru", 2, 8)
    simulate(lru, first)
    with pytest.raises(ValueError, match="replay it from empty"):
        simulate(lru, second)


def test_slots_that_disagree_with_their_index_are_declined_not_written():
    tr = synthetic_trace("zipf", requests=200)
    p = make_policy("kvtier", 20, tr.n_unique)
    resident = np.zeros(tr.n_unique, dtype=bool)
    run = p.compiled_replay(tr.block, tr.cls, resident)
    nxt, _ = run(0, 150)
    assert nxt == 150 and p.size == 20
    p.where[p.slots[: p.size]] = -1  # every resident's reverse index lost
    nxt, _ = run(150, tr.n_accesses)
    assert nxt < tr.n_accesses and not resident[tr.block[nxt]]  # stopped at the next miss
    assert p.slots.size == 20 and (p.where == -1).sum() == p.where.size


def test_read_only_trace_arrays_replay():
    tr = synthetic_trace("chat", requests=300)
    tr.block.setflags(write=False)
    tr.cls.setflags(write=False)
    (want, ref), (got, fast) = _both(tr, 30)
    assert got == want and fast == ref


@pytest.mark.parametrize("cls", [-1, 16, 2 ** 60 - 1])
def test_a_feature_class_out_of_range_is_refused_before_anything_is_recorded(cls):
    tr = _small([1, 2, 1, 3, 1])
    tr.cls = np.array([0, 0, cls, 0, 0], dtype=np.int64)
    (want, ref), (got, fast) = _both(tr, 4)
    assert want is IndexError and got is IndexError and fast == ref
    p = make_policy("kvtier", 4, 8)
    with pytest.raises(IndexError):
        simulate(p, tr)
    assert p.model.clock == 2  # the two accesses before it, nothing of the third


def test_a_calibration_window_leaves_the_ring_as_pairs_one_by_one_do():
    tr = synthetic_trace("chat", requests=800)
    (want, ref), (got, fast) = _both(tr, 40, calibration_sample=1, refresh_every=500, calibration_window=7)
    assert got == want and fast == ref


def test_a_pending_victim_is_cleared_as_the_hooks_clear_it():
    tr = synthetic_trace("chat", requests=200)

    def pend(p):  # a daemon-style admit of a full cache, never followed by its evict
        for b in range(p.capacity):
            p.insert(b, 0.0, 0, -1)
        p.admit(p.capacity + 1, 0.0, 0, -1)
    (want, ref), (got, fast) = _both(tr, 10, pend)
    assert got == want and fast == ref


def test_overridden_hooks_keep_the_replay_on_the_hooks():
    from kvtier.policy.value import ValuePolicy

    args = (np.zeros(3, np.int64), np.zeros(3, np.int64), np.zeros(8, bool))
    p = make_policy("kvtier", 4, 8)
    p.admit = lambda *a: True  # type: ignore[method-assign]
    assert p.compiled_replay(*args) is None  # on the instance

    class Unlinks(ValuePolicy):  # in a subclass, a method the kernel does itself
        def _unlink(self, b: int) -> None:
            super()._unlink(b)

    class Plain(ValuePolicy):
        pass

    assert Unlinks(4, 8).compiled_replay(*args) is None
    if value_compiled.available():
        assert Plain(4, 8).compiled_replay(*args) is not None


def test_registers_out_of_range_are_refused():
    tr = synthetic_trace("zipf", requests=50)
    p = make_policy("kvtier", 20, tr.n_unique)
    run = p.compiled_replay(tr.block, tr.cls, np.zeros(tr.n_unique, dtype=bool))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(value_compiled, "N_IRR", 0)
        with pytest.raises(ValueError, match="registers out of range"):
            run(0, 10)
    with pytest.raises(TypeError, match="format"):
        value_compiled._run((tr.block,) * 31, np.zeros(31, np.int64), np.zeros(7), 0, 1)
    assert p.model.clock == 0


def test_recalibration_arrays_that_do_not_match_the_registers_are_refused():
    tr = synthetic_trace("zipf", requests=200)
    p = make_policy("kvtier", 20, tr.n_unique, refresh_every=100)
    simulate(p, tr)  # scored from the first refresh on
    p.calib.recal.ceiling = np.zeros(3, dtype=np.float32)  # not one per model and bin
    run = p.compiled_replay(tr.block, tr.cls, np.isin(np.arange(tr.n_unique), p.residents()))
    before = _state(p)
    with pytest.raises(ValueError, match="recalibration"):
        run(0, 10)
    assert _state(p) == before


def test_a_corrupt_prediction_code_goes_to_the_hooks():
    """A pending prediction's code past the models' bins is not read by the kernel: the
    hooks take that access (and raise, indexing the counts with it), after the same
    accesses before it."""
    def prepare(p):
        p.model.refreshes = 1  # scored from here on
        p.calib.pred[1], p.calib.deadline[1] = 0.5, 1000.0
        p.calib.pending_code[1] = 200  # 8 models x 20 bins: codes 0..159, or 255 (untracked)

    (want, ref), (got, fast) = _both(_small([2, 3, 4, 1, 5]), 4, prepare, calibration_sample=1)
    assert want is IndexError and got is IndexError
    assert fast == ref
    p = make_policy("kvtier", 4, 8, calibration_sample=1)
    prepare(p)
    taken = _counting(p)
    with pytest.raises(IndexError):
        simulate(p, _small([2, 3, 4, 1, 5]))
    assert taken[0] == 3  # the kernel took the three before it and stopped


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
