"""kvtier's value policy: what it keeps, what importance does, queries that change nothing."""

import numpy as np

from kvtier.policy import make_policy
from kvtier.policy.shadow import ShadowCaches
from kvtier.replay.sim import simulate
from kvtier.replay.traces import Trace


def _trace(blocks: list[int], classes: list[int]) -> Trace:
    n = len(blocks)
    b = np.asarray(blocks, dtype=np.int64)
    return Trace("t", "mooncake", b, np.arange(n, dtype=float), np.asarray(classes, np.int64), np.arange(n), n,
                 int(b.max()) + 1)


def _loop_and_scan(rounds: int) -> Trace:
    """20 hot blocks (class 0) read in a loop, each read followed by 3 fresh blocks (class 1)."""
    blocks, classes, fresh = [], [], 100
    for _ in range(rounds):
        for b in range(20):
            blocks.append(b)
            classes.append(0)
            for _ in range(3):
                blocks.append(fresh)
                classes.append(1)
                fresh += 1
    return _trace(blocks, classes)


def test_a_reused_working_set_survives_a_scan_that_flushes_lru():
    tr = _loop_and_scan(400)  # reuse distance of a hot block: 80 accesses > the 40-block cache
    kv = simulate(make_policy("kvtier", 40, tr.n_unique), tr)
    lru = simulate(make_policy("lru", 40, tr.n_unique), tr)
    hot_reads = 400 * 20
    assert lru == 0  # every hot block is pushed out by 60 fresh ones before it returns
    assert kv > 0.9 * hot_reads  # admission keeps the scan out once the model has seen it


def _filled(n: int = 8):
    pol = make_policy("kvtier", n, 64, samples=16)
    for b in range(n):
        pol.observe(b, float(b), 0)
        pol.admit(b, float(b), 0, -1)
        pol.insert(b, float(b), 0, -1)
    return pol


def _arrays(obj) -> dict:
    out = {}
    for name, v in vars(obj).items():
        if isinstance(v, np.ndarray):
            out[name] = v.copy()
        elif hasattr(v, "__dict__") and not isinstance(v, type):
            out.update({f"{name}.{k}": a for k, a in _arrays(v).items()})
    return out


def test_victims_change_no_policy_state():
    pol = _filled()
    before = _arrays(pol)
    got = pol.victims(3, lambda c: c % 2 == 0)  # odd blocks are pinned
    after = _arrays(pol)
    assert before.keys() == after.keys()
    assert all(np.array_equal(before[k], after[k], equal_nan=True) for k in before)
    assert got.size == 3 and all(int(b) % 2 == 0 for b in got)


def test_importance_weight_changes_which_block_is_evicted():
    pol = _filled()
    # equal history but for age: the oldest (block 0) is the least likely to be reused soon
    plain = pol.victims(1, lambda c: np.ones(c.size, dtype=bool))
    pol.set_weights(np.array([int(plain[0])]), np.array([10.0]))  # important: keep it
    pol.set_weights(np.array([5]), np.array([0.01]))  # unimportant: evict it first
    assert int(pol.victims(1, lambda c: np.ones(c.size, dtype=bool))[0]) == 5


def test_a_freed_id_starts_afresh():
    pol = _filled()
    pol.set_weights(np.array([3]), np.array([0.2]))
    pol.remove(3)
    pol.on_freed(3)
    assert not pol.seen(3) and pol.weight[3] == 1.0 and int(pol.model.count[3]) == 0
    pol.observe(3, 100.0, 2)  # the next block with id 3: a first access of class 2
    assert int(pol.model.count[3]) == 1


def test_a_freed_id_leaves_every_shadow_miniature():
    """Each miniature's slots hold exactly the ids whose bit it has, once each, through random
    accesses and frees: a freed id left in a slot was admitted again beside it when recycled,
    and evicting either copy cleared the bit the other stood for (misses on a held block)."""
    rng = np.random.default_rng(5)
    pol = make_policy("kvtier", 4, 64)  # every block sampled; miniatures of 4
    sh, t = pol.shadows, 0
    for step in range(3000):
        b = int(rng.integers(0, 24))
        if rng.random() < 0.2:
            pol.on_freed(b)  # (a freed id is not resident in the real cache here: shadows only)
        else:
            t += 1
            pol.observe(b, float(t), int(rng.integers(0, 3)))
        for k in range(sh.k):
            held = sh.slots[k, :sh.size[k]].tolist()
            assert len(held) == len(set(held)), (step, k, held)
            assert set(held) == set(np.flatnonzero(sh.member >> k & 1).tolist()), (step, k)


def test_shadow_caches_choose_the_candidate_that_earns_hits():
    """A loop of 12 blocks over 8 slots: LRU-like ranking (candidate 0) almost never hits (victims are sampled),
    MRU-like ranking (candidate 1) keeps most of the loop."""
    last = np.zeros(64)
    clock = [0]

    def values(ks: np.ndarray, blocks: np.ndarray) -> np.ndarray:  # row i: candidate ks[i]'s values
        age = clock[0] - last[blocks]
        return np.where((ks == 0)[:, None], -age, age)

    def value_new(ks: np.ndarray, b: int) -> np.ndarray:
        return np.where(ks == 0, 0.0, -1e9)

    sh = ShadowCaches(capacity=8, max_blocks=64, n_candidates=2, target_blocks=8, samples=8)
    assert sh.capacity == 8 and sh.sampled(5)  # rate 1: every block is in the sample
    for _ in range(50):
        for b in range(12):
            clock[0] += 1
            last[b] = clock[0]
            sh.access(b, values, value_new)
    assert sh.hits[1] > 4 * sh.hits[0] and sh.hits[1] > 100 and sh.best(current=0) == 1


def test_no_prediction_is_scored_before_the_model_has_evidence():
    """Until its first refresh the model's table is a recency ranking (P 1.0 at age 0), not
    a probability: scoring it put 0.95 predictions against a 0.39 outcome rate into the ECE."""
    tr = _loop_and_scan(10)  # 800 accesses
    pol = make_policy("kvtier", 40, tr.n_unique, refresh_every=500, calibration_sample=1)
    blocks, classes = tr.block.tolist(), tr.cls.tolist()
    for i in range(499):  # every access a decision: misses past the first 40 admit or bypass
        b = blocks[i]
        pol.observe(b, float(i), classes[i])
        if pol.where[b] < 0 and pol.admit(b, float(i), classes[i], -1):
            if pol.size >= pol.capacity:
                pol.evict(float(i))
            pol.insert(b, float(i), classes[i], -1)
    assert pol.model.refreshes == 0
    assert pol.calib.n_scored == 0 and np.isnan(pol.calib.pred).all()
    simulate(pol, _trace(blocks[499:], classes[499:]))  # the first refresh comes at access 500
    assert pol.model.refreshes >= 1 and not np.isnan(pol.calib.pred).all()


def test_a_weighted_newcomer_that_ties_its_victim_keeps_the_incumbent():
    """The newcomer's value and the victim's are the same float32 product when table and
    weight are equal (a float64 product for one side broke ties at random), and a tie keeps
    the resident: displacing an equal costs a copy and gains nothing (on a loop longer than
    the cache, admitting on ties cycled it like LRU: no hits)."""
    pol = _filled()
    pol.model.table3[:] = 0.3
    pol.set_weights(np.arange(64), np.full(64, 0.7))
    pol.observe(20, 20.0, 0)
    assert not pol.admit(20, 20.0, 0, -1) and pol.bypassed == 1
    pol.set_weights(np.array([21]), np.array([0.7001]))
    pol.observe(21, 21.0, 0)
    assert pol.admit(21, 21.0, 0, -1) and pol.bypassed == 1


def _first_pass(floor: float, n: int = 6000, cap: int = 50, policy: list | None = None) -> list[set[int]]:
    """Residents of a kvtier cache after 3,000 and 6,000 accesses of a loop's first pass:
    every fifth access reads a shared block (block 0, the only one that comes back),
    the rest are blocks seen once, through the policy's hooks."""
    p = make_policy("kvtier", cap, n + 1, refresh_every=500, evidence_floor=floor)
    if policy is not None:
        policy.append(p)
    resident = np.zeros(n + 1, dtype=bool)
    out = []
    for i in range(n):
        b = 0 if i % 5 == 0 else i
        p.observe(b, float(i), 0)
        if not resident[b] and p.admit(b, float(i), 0, -1):
            if p.size >= cap:
                resident[p.evict(float(i))] = False
            p.insert(b, float(i), 0, -1)
            resident[b] = True
        if i + 1 in (3000, n):
            out.append(set(np.flatnonzero(resident).tolist()) - {0})
    return out


def test_without_evidence_of_reuse_the_residents_stay():
    """Before any block but a shared one has come back, values differ only by the prior's
    shape, which the shared block's short reuses make favour the young: with the evidence
    floor the cache keeps what it holds (a fixed share of a loop, as LIRS does); without
    it, it cycles like LRU and holds only recent blocks."""
    held, still = _first_pass(0.01)
    assert held == still and min(held) < 1000  # frozen since the first refreshes
    cycled, later = _first_pass(0.0)
    assert not cycled & later and min(later) > 5000


def test_the_daemons_admission_verdict_applies_the_evidence_floor():
    """``admit_many`` (the daemon's admission, and what it publishes) declines as ``admit``
    does: a block seen once, against residents with no evidence of reuse either."""
    verdicts = []
    for floor in (0.01, 0.0):
        pol: list = []
        _first_pass(floor, policy=pol)
        p = pol[0]
        new = 6000  # seen once, now
        p.observe(new, 6000.0, 0)
        verdicts.append(bool(p.admit_many(np.array([new]), np.array([0]))[0]))
    assert verdicts == [False, True]


def test_the_floor_waits_for_the_first_refresh():
    """Before the first refresh the tables are the recency ranking, not probabilities (a
    density model's are all 0): the floor must not turn every miss away then."""
    p = make_policy("kvtier", 10, 100, default_candidate=6, evidence_floor=0.5)
    for b in range(60):
        p.observe(b, float(b), 0)
        if p.admit(b, float(b), 0, -1):
            if p.size >= 10:
                p.evict(float(b))
            p.insert(b, float(b), 0, -1)
    assert p.model.refreshes == 0 and p.bypassed == 0
