"""The Beta reuse model: counts read off the access stream, posteriors per cell, shrinkage, reset."""

import math

import numpy as np
import pytest

from kvtier.predictor import reuse_model
from kvtier.predictor.cells import N_IRR
from kvtier.predictor.classes import N_STAGES, STAGE_OF_COUNT
from kvtier.predictor.reuse_model import Candidate, ReuseModel, distance_bucket


def _cell(cls: int, count: int, irr: int = 0) -> int:
    """The cell of an access of feature class ``cls``, the block's ``count``-th."""
    return (cls * N_STAGES + STAGE_OF_COUNT[count]) * N_IRR + irr


def test_counts_are_reuse_distances_of_the_cell_of_the_previous_access():
    m = ReuseModel(8, refresh_every=10_000)
    m.access(3, cls=1)  # clock 1: first access, cell (1, stage 1)
    m.access(5, cls=2)  # clock 2
    m.access(3, cls=1)  # clock 3: reuse of block 3 at distance 2, counted in its previous cell
    first = _cell(1, 1)
    # weighted as its access now is: no refresh decayed it yet, so whole
    assert m.reuses[first].tolist() == [0.0] * 2 + [1.0] + [0.0] * (m.reuses.shape[1] - 3)  # bucket(2) = 2
    assert m.accesses[first] == 1.0 and m.accesses[_cell(2, 1)] == 1.0
    # the second access is stage 2 and remembers its reuse distance (octave 1)
    assert int(m.cell[3]) == _cell(1, 2, irr=1 + 2 // 4) and int(m.count[3]) == 2
    assert m.accesses[int(m.cell[3])] == 1.0


def test_distance_buckets_are_half_octaves():
    d = np.array([1, 2, 3, 4, 8, 1 << 30])
    assert distance_bucket(d).tolist() == [0, 2, 3, 4, 6, 47]


def test_a_class_reused_soon_is_worth_more_than_one_never_reused():
    cands = (Candidate("class_stage", 4.0),)
    m = ReuseModel(4000, candidates=cands, refresh_every=500, initial_age=50.0)
    # class 0: blocks 0..9 read in a loop (distance 10); class 1: a scan of fresh blocks
    nxt = 100
    for _ in range(300):
        for b in range(10):
            m.access(b, cls=0)
            m.access(nxt, cls=1)
            nxt += 1
    m.refresh()
    loop = float(m.values(0, np.array([3]))[0])
    scan = float(m.values(0, np.array([nxt - 1]))[0])
    assert loop > 0.95 and scan < 0.05


def test_a_cell_without_evidence_answers_with_its_parents_hazard():
    """Hazard = reuses in a distance bucket / accesses still at risk there, shrunk towards
    the parent cell (class x stage -> stage -> all) with ``prior_strength`` observations."""
    cands = (Candidate("class_stage", 4.0),)
    m = ReuseModel(64, candidates=cands, refresh_every=10_000, prior_strength=2.0, initial_age=8.0)
    m.reuses[_cell(0, 1), 4] = 30.0  # class 0, stage 1: 30 of 40 reused at distance 4-5
    m.accesses[_cell(0, 1)] = 40.0
    m.accesses[_cell(1, 1)] = 40.0  # class 1, stage 1: 40, never reused
    # the accesses not reused are their blocks' latest, long ago: censored far past bucket 4
    m.clock = 2000
    for b, cell in enumerate([_cell(0, 1)] * 10 + [_cell(1, 1)] * 40):
        m.count[b], m.cell[b], m.last[b] = 1, cell, 1000
    m.refresh()
    pooled = 30.0 / (1.0 + 80.0)
    stage1 = (2.0 * pooled + 30.0) / (2.0 + 80.0)
    # at age 0 the window (32 accesses) covers bucket 4, the only one with a hazard
    assert m.tables[0][_cell(0, 1), 0] == pytest.approx((2.0 * stage1 + 30.0) / 42.0)
    assert m.tables[0][_cell(1, 1), 0] == pytest.approx((2.0 * stage1 + 0.0) / 42.0)
    assert m.tables[0][_cell(5, 1), 0] == pytest.approx(stage1)  # never seen: its parent's rate
    # past distance 5.6 (bucket 4) nothing is reused: an older block's window holds no reuse
    assert m.tables[0][_cell(0, 1), 8] == pytest.approx(0.0)


def test_accesses_not_yet_reused_are_censored_not_counted_as_never():
    """A block accessed 3 accesses ago says nothing about reuse at distance 100."""
    cands = (Candidate("all", 1.0),)
    m = ReuseModel(64, candidates=cands, refresh_every=10_000, initial_age=1000.0, memory_horizons=1e9)
    for b in range(40):  # 40 blocks each read once just now: all pending, all censored young
        m.access(b, cls=0)
    m.reuses[_cell(0, 1), 13] = 10.0  # and 10 earlier accesses reused at distance ~100
    m.accesses[_cell(0, 1)] += 10.0
    m.refresh()
    # at risk at distance 100: the 10 old accesses only; without censoring it would be 50
    assert m.tables[0][_cell(0, 1), 0] == pytest.approx(10.0 / 11.0)


def test_counts_decay_with_the_eviction_age_not_a_constant():
    m = ReuseModel(4, refresh_every=100, memory_horizons=10.0, initial_age=50.0)
    m.accesses[:] = 1.0
    m.refresh()
    assert m.accesses[0] == pytest.approx(math.exp(-100 / (10.0 * 50.0)))


def test_reset_gives_a_recycled_id_no_history():
    m = ReuseModel(4, refresh_every=10_000)
    m.access(2, cls=0)
    m.access(2, cls=0)
    m.reset(2)
    before = m.reuses.copy()
    m.access(2, cls=3)  # a new block with the same id: a first access, not a reuse
    assert np.array_equal(m.reuses, before) and int(m.count[2]) == 1 and int(m.cell[2]) == _cell(3, 1)


def test_bad_candidates_are_refused():
    with pytest.raises(ValueError, match="partition"):
        ReuseModel(4, candidates=(Candidate("nope", 1.0),))
    with pytest.raises(ValueError, match="at least one"):
        ReuseModel(4, candidates=())


def test_partition_sums_match_their_cell_maps():
    from kvtier.predictor.cells import N_CELLS, PARTITIONS, SUM_ROWS

    a = np.random.default_rng(0).random((N_CELLS, 3))
    for name, cmap in PARTITIONS.items():
        expect = np.zeros((int(cmap.max()) + 1, 3))
        np.add.at(expect, cmap, a)
        assert np.allclose(SUM_ROWS[name](a), expect), name


def _fine_cell_hazard(m: ReuseModel, partition: str, pending: np.ndarray) -> np.ndarray:
    """The hazard computed the plain way: one row per fine cell, each from its partition
    group's summed counts, shrunk towards the parent hazard of the same fine cell."""
    from kvtier.predictor.cells import N_IRR, ORDINAL, PARENT, PARTITIONS
    from kvtier.predictor.classes import N_STAGES

    cmap = PARTITIONS[partition]

    def group(a: np.ndarray) -> np.ndarray:
        out = np.zeros((int(cmap.max()) + 1,) + a.shape[1:])
        np.add.at(out, cmap, a)
        return out[cmap]

    reuses, total, censored = group(m.reuses), group(m.accesses), group(pending)
    gone = np.cumsum(reuses + censored, axis=1)
    before = np.concatenate((np.zeros((cmap.size, 1)), gone[:, :-1]), axis=1)
    at_risk = np.maximum(total[:, None] - before - 0.5 * censored, 0.0)  # censored: half exposed
    parent = PARENT[partition]
    prior, strength = (0.0, 1.0) if parent is None else (_fine_cell_hazard(m, parent, pending), m.m)
    hazard = np.minimum((strength * prior + reuses) / (strength + at_risk), 1.0)
    if partition in ORDINAL:  # past the first stage: the same class's previous stage is the prior
        stage = np.arange(cmap.size) // N_IRR % N_STAGES
        for s in range(1, N_STAGES):
            rows = np.flatnonzero(stage == s)
            hazard[rows] = np.minimum((strength * hazard[rows - N_IRR] + reuses[rows]) / (strength + at_risk[rows]),
                                      1.0)
    return hazard


def test_hazards_per_partition_cell_expand_to_the_fine_cell_computation():
    """Tables are built per partition cell and expanded when written: the expansion must
    equal computing every fine cell on its own, for every partition."""
    from kvtier.predictor.cells import PARTITIONS

    rng = np.random.default_rng(3)
    m = ReuseModel(64, refresh_every=10_000)
    m.reuses[:] = rng.poisson(0.5, m.reuses.shape) * (rng.random(m.reuses.shape[0]) < 0.3)[:, None]
    m.accesses[:] = m.reuses.sum(1) + rng.poisson(2.0, m.accesses.shape)
    pending = rng.random(m.reuses.shape) * (rng.random(m.reuses.shape) < 0.05)
    memo: dict = {}
    for name, cmap in PARTITIONS.items():
        got = m._hazard(name, pending, memo)[cmap]
        assert np.allclose(got, _fine_cell_hazard(m, name, pending), rtol=1e-12, atol=0.0), name


def test_tables_from_distinct_hazard_rows_equal_every_cell_computed(monkeypatch):
    """A refresh computes each distinct hazard row once and expands it to its cells; the
    tables (window probabilities and densities, every candidate) must be the ones computing
    every cell on its own gives, bit for bit."""
    rng = np.random.default_rng(11)
    blocks = rng.zipf(1.3, size=6000) % 700
    tables = []
    for dedup in (True, False):
        with monkeypatch.context() as mp:
            if not dedup:
                mp.setattr(reuse_model, "distinct_rows", lambda a: (a, np.arange(a.shape[0])))
            m = ReuseModel(700, refresh_every=1000, initial_age=60.0)
            for i, b in enumerate(blocks.tolist()):
                m.access(int(b), cls=i % 5)
            tables.append((m.table3.copy(), {k: v.copy() for k, v in m.prob.items()}))
    (t1, p1), (t2, p2) = tables
    assert t1.tobytes() == t2.tobytes()
    assert p1.keys() == p2.keys() and all(p1[k].tobytes() == p2[k].tobytes() for k in p1)
    assert np.unique(t1[0].reshape(reuse_model.N_AGES, -1), axis=1).shape[1] < t1.shape[2] // 2  # rows were shared


def test_one_gather_over_all_candidates_equals_each_candidates_lookup():
    """The shadow caches value every candidate at once (``values_rows``); it must agree,
    element for element, with candidate-by-candidate lookups, and with the [cell, age] views."""
    m = ReuseModel(500, refresh_every=300, initial_age=40.0)
    rng = np.random.default_rng(7)
    for b in rng.integers(0, 500, size=5000).tolist():
        m.access(int(b), cls=int(b) % 3)
    ks = np.array([0, 3, 5, 1])
    blocks = rng.integers(0, 500, size=(4, 9))
    rows = m.values_rows(ks, blocks)
    for i, k in enumerate(ks.tolist()):
        assert rows[i].tolist() == m.values(k, blocks[i]).tolist()
        ages = m.age_buckets(blocks[i])
        assert rows[i].tolist() == m.tables[k][m.cell[blocks[i]], ages].tolist()
    assert m.values_just_accessed(ks, 17).tolist() == [m.value_just_accessed(k, 17) for k in ks.tolist()]


def test_compiled_victim_search_equals_numpy(monkeypatch):
    """``lowest`` (one compiled call on every miss of a full cache) picks the same block
    with the same value as the numpy path, weighted or not, with ties (first lowest
    wins) and with ages past the table's last bucket."""
    if reuse_model._c_lowest is None:
        pytest.skip("the compiled victim search (kernels/_value.c) was not built")
    m = ReuseModel(400, refresh_every=250, initial_age=30.0)
    rng = np.random.default_rng(8)
    weight = rng.choice(np.array([0.25, 0.5, 1.0, 3.0], dtype=np.float32), size=400)
    checked = 0
    for step, b in enumerate(rng.integers(0, 400, size=6000).tolist()):
        m.access(int(b), cls=int(b) % 4)
        if step % 7 or not m.refreshes:
            continue
        blocks = rng.integers(0, 400, size=int(rng.integers(1, 20)))
        for k in range(len(m.candidates)):
            for w in (None, weight):
                got = m.lowest(k, blocks, w)
                with monkeypatch.context() as mp:
                    mp.setattr(reuse_model, "_c_lowest", None)
                    want = m.lowest(k, blocks, w)
                assert got == want, (step, k, w is not None)
                checked += 1
    assert checked > 1000
    m.clock += 10**9  # every block far past the last age bucket: all tie at the oldest bucket's value
    blocks = np.arange(50, dtype=np.int64)
    got = m.lowest(0, blocks)
    with monkeypatch.context() as mp:
        mp.setattr(reuse_model, "_c_lowest", None)
        assert got == m.lowest(0, blocks)
    with pytest.raises(IndexError):
        m.lowest(0, np.array([400]))  # a block id past the model's arrays: refused, not read
    assert m.lowest(0, blocks.astype(np.int32)) == got  # other index types take the numpy path


def test_hit_density_keeps_rising_towards_a_reuse():
    """A loop of 400 blocks (every reuse at distance 400), horizon 800 accesses: P(reused
    within W) is ~1 at every age below 400, so it cannot tell a block 50 accesses from its
    reuse from one 350 away (and a short horizon would see 0 for both); hit density can
    (about 1 / remaining distance). The density candidate's P is still the probability
    that calibration scores."""
    cands = (Candidate("class_stage", 8.0), Candidate("class_stage", 8.0, density=True))
    m = ReuseModel(400, candidates=cands, refresh_every=1000, initial_age=100.0)
    for _ in range(12):
        for b in range(400):
            m.access(b, cls=0)
    m.refresh()
    assert m.horizons.tolist() == [800.0, 800.0]
    cell = int(m.cell[0])
    ages = (np.array([50, 200, 340]) / m.granularity).astype(int)  # age-bucket indices
    p = m.tables[0][cell, ages]
    dens = m.tables[1][cell, ages]
    assert p.min() > 0.95 and p.max() - p.min() < 0.05  # P: flat, blind to how close the reuse is
    assert 0 < dens[0] < dens[1] < dens[2] and dens[2] > 3 * dens[0]  # closer to the reuse: worth more
    assert np.array_equal(m.prob[1], m.table3[0])  # the density model's P is the P model's table
    assert m.probability_just_accessed(1, 0) == m.value_just_accessed(0, 0)


def test_stages_are_exact_to_three_accesses_then_octaves_and_counts_saturate():
    assert [STAGE_OF_COUNT[c] for c in (1, 2, 3, 4, 7, 8, 15, 16, 255)] == [0, 1, 2, 3, 3, 4, 4, 5, 5]
    m = ReuseModel(4, refresh_every=10_000)
    cells = []
    for _ in range(300):
        m.access(1, cls=2)
        cells.append(int(m.cell[1]) // N_IRR)  # class x stage, without the reuse distance
    assert int(m.count[1]) == 255  # saturated, not wrapped to 0 (a uint8)
    stages = [c - 2 * N_STAGES for c in cells]
    assert stages[:20] == [0, 1, 2, 3, 3, 3, 3, 4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5]
    assert set(stages[20:]) == {5}  # a block read 20 times is told from one read 4 times


def test_a_reuse_counts_as_much_as_its_access_does_by_then():
    """Forgetting by the age of the access the evidence is about: after any number of
    refreshes, a reuse at distance d weighs what its access weighs in ``accesses``. Counted
    at full weight, a loop whose reuses lie near tau read reuses above accesses."""
    cands = (Candidate("all", 1.0),)
    m = ReuseModel(600, candidates=cands, refresh_every=97, initial_age=10.0, memory_horizons=30.0)  # tau 300
    for _ in range(6):
        for b in range(500):  # a loop: every reuse at distance 500, > tau
            m.access(b, cls=0)
    cell = _cell(0, 2, irr=1 + int(distance_bucket(np.array([500]))[0]) // 4)
    first = _cell(0, 1)
    # the first pass's accesses (stage 1) were all reused, each at distance 500: whatever the
    # decay since, the reuses they left weigh exactly what they keep (no refresh changed tau);
    # at full weight they read ~e^(500/300) = 5.3x their accesses
    assert m.eviction_age == 10.0
    assert m.reuses[first].sum() == pytest.approx(m.accesses[first], rel=1e-9)
    assert m.reuses[cell].sum() <= m.accesses[cell] * (1 + 1e-9)  # later passes: some not reused yet


def test_a_reuse_weighs_its_access_while_tau_moves_and_after_an_extra_refresh():
    """The eviction age (so tau, so each refresh's decay) is re-estimated at every refresh,
    and a refresh may be asked for off its grid: a reuse still weighs exactly what its
    access does, every decay since it counted as applied (the running total at each refresh
    period), not the latest rate times the refreshes since."""
    cands = (Candidate("all", 1.0),)
    m = ReuseModel(600, candidates=cands, refresh_every=97, initial_age=10.0, memory_horizons=30.0)
    for b in range(500):  # the first pass: stage 1, every block reused once, at distance 500
        m.access(b, cls=0)
        if b % 97 == 50:
            m.evicted(b)  # moves the eviction age at the next refresh: tau changes
            m._ev_sum += 3.0 * b
    m.refresh()  # an extra refresh, off the grid: it decays the counts like any other
    for b in range(500):
        m.access(b, cls=0)
    assert m.eviction_age != 10.0
    first = _cell(0, 1)
    assert m.reuses[first].sum() == pytest.approx(m.accesses[first], rel=1e-9)


def test_a_window_reads_survival_inside_its_buckets_not_at_their_edges():
    """P(reused within W | age) = 1 - S(age + W) / S(age) with S log-linear inside a bucket:
    a constant hazard per access. One cell, one hazard h in bucket 10 ([32, 45.25)): a window
    ending a third of the way into it holds a third of the bucket's log-survival. Read at the
    bucket's far edge (as before), the window was widened to all of it."""
    cands = (Candidate("all", 1.0),)
    m = ReuseModel(64, candidates=cands, refresh_every=10**6, initial_age=8.0, memory_horizons=1e12)
    m.reuses[0, 10] = 50.0  # half of 100 accesses reused in bucket 10, the rest never:
    m.accesses[0] = 100.0
    m.clock = 200_000  # those are their blocks' latest, censored far past bucket 10
    m.count[:50], m.cell[:50], m.last[:50] = 1, 0, 100_000
    m.refresh()
    h = 50.0 / (1.0 + 100.0)  # the root cell: prior 0 with one pseudo-observation
    edge, width = 2.0 ** 5, 2.0 ** 5.5 - 2.0 ** 5
    w = m.horizons[0]  # one eviction age: 8 accesses
    for age_bucket in range(N_AGES_CHECKED):
        age = age_bucket * m.granularity
        lo, hi = age + 1.0, age + 1.0 + w
        inside = (min(max(hi, edge), edge + width) - min(max(lo, edge), edge + width)) / width
        expected = 1.0 - (1.0 - h) ** inside
        got = float(m.tables[0][0, age_bucket])
        assert got == pytest.approx(expected, rel=1e-5, abs=1e-7), age_bucket


N_AGES_CHECKED = 64


def test_reuses_in_the_open_last_bucket_still_count():
    """Distances past 2^23.5 accesses share the last bucket; its hazard is spread over the
    width it would have (to 2^24), survival flat after. A node with 10^6-block caches has
    eviction ages near 10^5, and its 128-eviction-age density model looks that far."""
    cands = (Candidate("all", 1.0),)
    m = ReuseModel(64, candidates=cands, refresh_every=10**6, initial_age=2.0 ** 22, memory_horizons=1e12)
    m.reuses[0, 47] = 50.0  # half of 100 accesses reused beyond 2^23.5, the rest not yet:
    m.accesses[0] = 100.0
    m.clock = 1 << 25  # those are their blocks' latest, 2^24 ago: censored in the last bucket
    m.count[:50], m.cell[:50], m.last[:50] = 1, 0, (1 << 25) - (1 << 24)
    m.refresh()
    h = 50.0 / (1.0 + 100.0 - 0.5 * 50.0)  # a censored access is at risk for half its bucket
    w = m.horizons[0]  # 2^22 accesses: from age 0 the window ends before the last bucket
    assert float(m.tables[0][0, 0]) == pytest.approx(0.0, abs=1e-7)
    age = 24 * m.granularity  # 3 * 2^22 = 2^23.58: the window [2^23.58, 2^24.17) covers the rest of it
    expected = 1.0 - (1.0 - h) ** ((2.0 ** 24 - (age + 1.0)) / (2.0 ** 24 - 2.0 ** 23.5))
    assert float(m.tables[0][0, 24]) == pytest.approx(expected, rel=1e-4)
    assert w == 2.0 ** 22


def test_a_stage_without_evidence_takes_the_previous_stage_not_the_hottest_block():
    """Class x stage cells past the first stage shrink towards the same class's previous
    stage: a block on its second access, in a stage nothing has reached yet, is expected
    to behave as it did on its first (reused at the loop's distance), not as the shared
    block that dominates the pooled parent (reused within a few accesses)."""
    from kvtier.predictor.cells import PARTITIONS

    m = ReuseModel(64, refresh_every=10_000)
    first = (0 * N_STAGES + STAGE_OF_COUNT[1]) * N_IRR  # class 0, first access, never reused before
    hot = (0 * N_STAGES + STAGE_OF_COUNT[200]) * N_IRR + 1  # class 0, the shared block's stage
    far, near = distance_bucket(np.array([7000]))[0], distance_bucket(np.array([5]))[0]
    m.accesses[first], m.reuses[first, far] = 1000.0, 700.0
    m.accesses[hot], m.reuses[hot, near] = 5000.0, 5000.0
    hazard = m._hazard("class_stage", np.zeros_like(m.reuses), {})
    rows = PARTITIONS["class_stage"]
    second = rows[(0 * N_STAGES + STAGE_OF_COUNT[2]) * N_IRR]  # class 0, second access: no evidence
    assert np.array_equal(hazard[second], hazard[rows[first]])
    assert hazard[second, far] > 0.5 and hazard[second, near] < 1e-3
    pooled = m._hazard("stage", np.zeros_like(m.reuses), {})[STAGE_OF_COUNT[2]]
    assert pooled[near] > 0.5  # what the parent partition would have lent it
