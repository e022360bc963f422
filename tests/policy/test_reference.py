"""Published reference policies on hand-made traces: exact hits and eviction orders.

Every expectation below was derived by hand from the paper's rules (the
comments walk through it); block ids are their own dense ids.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.policy import make_policy
from kvtier.policy.tinylfu import CountMinSketch
from kvtier.replay.sim import simulate

from ..replay.test_replay import _evictions, _trace


def _hits(name: str, seq: list[int], cap: int, **params) -> int:
    tr = _trace(seq)
    return simulate(make_policy(name, cap, tr.n_unique, **params), tr, None)


def test_sieve():
    # cap 3; queue oldest..newest. 0 1 2 fill [0 1 2]; 0 hit sets visited(0).
    # 3: hand starts at the oldest, 0: visited -> cleared, 1: evicted; hand on 2.  [0 2 3]
    # 1: hand on 2, unvisited -> evicted; hand on 3.                                 [0 3 1]
    # 4: 3 evicted; hand on 1.  0 hit: visited(0).  2: hand on 1 -> evicted.         [0 4 2]
    # 0 survives every pass (one hit is enough); LRU would have evicted it at 4.
    seq = [0, 1, 2, 0, 3, 1, 4, 0, 2]
    assert _evictions("sieve", seq, 3) == [1, 2, 3, 1]
    assert _hits("sieve", seq, 3) == 2


def test_arc():
    # cap 2, p = 0. 0 1 -> T1 [0 1]; 0 hit -> T2 [0], T1 [1].
    # 2 (case IV, |T1|+|B1| = 1 < 2): REPLACE, |T1| = 1 > p -> 1 to B1.         T1 [2]  T2 [0]  B1 [1]
    # 3 (IV, |T1|+|B1| = 2 = c, |T1| < c): B1 drops 1; REPLACE -> 2 to B1.      T1 [3]  T2 [0]  B1 [2]
    # 0 hit in T2.
    # 2 in B1: p += max(|B2| // |B1|, 1) = 1; REPLACE, |T1| = 1 = p -> T2's 0 to B2.  T1 [3] T2 [2] B2 [0]
    # 0 in B2: p -= max(|B1| // |B2|, 1) -> 0; REPLACE, |T1| > p -> 3 to B1.     T2 [2 0]  B1 [3]
    # 3 in B1: p -> 1; REPLACE, |T1| = 0 -> T2's LRU 2 to B2.                   T2 [0 3]
    seq = [0, 1, 0, 2, 3, 0, 2, 0, 3]
    assert _evictions("arc", seq, 2) == [1, 2, 0, 3, 2]
    tr = _trace(seq)
    pol = make_policy("arc", 2, tr.n_unique)
    assert simulate(pol, tr, None) == 2 and pol.p == 1.0
    assert pol.lists.to_array(1).tolist() == [0, 3] and pol.lists.to_array(3).tolist() == [2]


def test_lirs():
    # cap 3: 1 HIR slot, 2 LIR. S bottom..top, Q head..tail; nr = non-resident HIR.
    # 0 1 -> LIR (warm-up). 2 -> HIR: S [0 1 2] Q [2].
    # 3: Q's 2 evicted (stays in S as nr); 3 HIR: S [0 1 2nr 3] Q [3].
    # 1 hit. 0 hit at the bottom -> top, pruning removes 2nr and 3: S [1 0] Q [3].
    # 2: 3 evicted (not in S: forgotten); 2 HIR: S [1 0 2] Q [2].
    # 3: 2 evicted (nr in S); 3 HIR: S [1 0 2nr 3] Q [3].
    # 2: 3 evicted (nr); 2 is nr in S -> LIR; bottom LIR 1 -> HIR in Q: S [0 3nr 2] Q [1].
    # 1 hit (HIR, not in S): S [0 3nr 2 1] Q [1].
    # 3: 1 evicted (nr); 3 nr in S -> LIR; bottom LIR 0 -> Q: S [2 1nr 3] Q [0].
    seq = [0, 1, 2, 3, 1, 0, 2, 3, 2, 1, 3]
    assert _evictions("lirs", seq, 3) == [2, 3, 2, 3, 1]
    tr = _trace(seq)
    pol = make_policy("lirs", 3, tr.n_unique)
    assert simulate(pol, tr, None) == 3
    assert pol.S.to_array().tolist() == [2, 1, 3] and pol.Q.to_array().tolist() == [0]
    assert pol.state.tolist() == [2, 3, 1, 1]  # 0 HIR, 1 non-resident HIR, 2 and 3 LIR


def test_lirs_at_one_and_two_blocks():
    # cap 1: one LIR slot and no HIR slot (1% of 1 would leave none for LIR: a promoted block
    # then demoted a non-resident one into Q, and evict returned a block the cache did not hold).
    # Each miss evicts the one block, as any policy without bypass must: a hit is an immediate repeat.
    assert _hits("lirs", [0, 1, 0, 1, 0, 1, 0, 1, 2, 0, 2, 0], 1) == 0
    assert _hits("lirs", [0, 0, 1, 1, 1, 0, 2, 2], 1) == 4
    assert _evictions("lirs", [0, 0, 1, 1, 1, 0, 2, 2], 1) == [0, 1, 0]
    pol = make_policy("lirs", 1, 3)
    assert (pol.l_lirs, pol.l_hirs) == (1, 0)
    # cap 2: 1 LIR, 1 HIR slot. 0 LIR (warm-up), 1 HIR: S [0 1] Q [1].
    # 0 hit at the bottom: to the top, pruning drops 1: S [0] Q [1].  1 hit (HIR out of S): S [0 1].
    # ... 0 and 1 alternate, all hits (6).  2: Q's 1 evicted (nr in S); 2 HIR: S [0 1nr 2] Q [2].
    # 0 hit at the bottom: pruning drops 1nr and 2: S [0].  2 hit, 0 hit: 9 hits (Belady's too; LRU 8).
    assert _hits("lirs", [0, 1, 0, 1, 0, 1, 0, 1, 2, 0, 2, 0], 2) == 9
    # cap 2: 0 LIR, 1 HIR. 2: 1 evicted (nr); 2 HIR: S [0 1nr 2] Q [2].
    # 1: 2 evicted (nr); 1 nr in S -> LIR, bottom LIR 0 -> Q; pruning drops 2nr: S [1] Q [0].
    # 0 hit (HIR out of S): S [1 0].  0 hit, now in S -> LIR; bottom 1 -> Q, pruned: S [0] Q [1].
    # 2: 1 evicted (not in S); 2 HIR: S [0 2] Q [2].  1: 2 evicted (nr); 1 HIR.  2 hits.
    assert _evictions("lirs", [0, 1, 2, 1, 0, 0, 2, 1], 2) == [1, 2, 1, 2]
    assert _hits("lirs", [0, 1, 2, 1, 0, 0, 2, 1], 2) == 2


def test_lirs_keeps_a_lir_slot_whatever_the_hir_fraction():
    for cap in (1, 2, 3, 10):
        pol = make_policy("lirs", cap, 50, hir_fraction=1.0)
        assert pol.l_lirs >= 1 and pol.l_lirs + pol.l_hirs == cap
    rng = np.random.default_rng(2)
    tr = _trace(rng.integers(0, 12, 400).tolist())
    for cap in (1, 2, 3, 5):  # every victim is resident (simulate checks it) and hits stay within Belady's
        hits = simulate(make_policy("lirs", cap, tr.n_unique, hir_fraction=1.0), tr, None, compiled=False)
        assert hits <= simulate(make_policy("belady", cap, tr.n_unique), tr, tr.next_use())


def test_lirs_bounds_its_non_resident_history():
    rng = np.random.default_rng(1)
    tr = _trace(rng.integers(0, 400, 3000).tolist())
    pol = make_policy("lirs", 20, tr.n_unique, nonresident=2.0)
    simulate(pol, tr, None)
    assert pol.n_nr == int((pol.state == 3).sum()) <= 40
    assert pol.S.length() == int((pol.state == 1).sum() + (pol.state == 3).sum()
                                 + ((pol.state == 2) & (pol.S.owner == 0)).sum())


def test_w_tinylfu():
    # cap 3: window 1, main 2 (protected 1). Frequencies are exact here (8 keys, 16 columns x 4 rows).
    # 0 1 2: window overflow moves 0, then 1 to probation. 0 hit -> protected; 0 hit.
    # 3: candidate 2 (f=1) vs probation's 1 (f=1): not more frequent -> 2 evicted.  4: likewise 3.
    # 1 hit -> protected, whose overflow 0 goes back to probation. 4 hit (window).
    # 5: candidate 4 (f=2) vs 0 (f=3): 4 evicted.  2 (f=2): candidate 5 (f=1) evicted.
    # 2 2 hits (f=4).  7: candidate 2 (f=4) beats 0 (f=3): 0 evicted, 2 to probation.
    seq = [0, 1, 2, 0, 0, 3, 4, 1, 4, 5, 2, 2, 2, 7]
    assert _evictions("w-tinylfu", seq, 3) == [2, 3, 4, 5, 0]
    assert _hits("w-tinylfu", seq, 3) == 6


def test_count_min_sketch_caps_at_15_and_halves_at_the_sample_size():
    s = CountMinSketch(16, sample=10)
    for _ in range(9):
        s.add(1)
    assert s.estimate(1) == 9 and s.estimate(2) == 0
    s.add(1)  # the 10th addition: counters halve
    assert s.estimate(1) == 5 and s.additions == 5
    big = CountMinSketch(16, sample=1000)
    for _ in range(40):
        big.add(3)
    assert big.estimate(3) == 15


def test_doorkeeper_absorbs_first_sightings():
    s = CountMinSketch(16, sample=6, doorkeeper=True)
    s.add(4)
    assert s.estimate(4) == 1 and not s.table.any()  # only the Bloom filter knows it
    s.add(4)
    s.add(4)
    assert s.estimate(4) == 3 and s.table.max() == 2
    for _ in range(3):
        s.add(9)  # the 6th addition resets: counters halve, the doorkeeper empties
    assert not s.door.any() and s.estimate(4) == 1 and s.additions == 3


def test_2q():
    # cap 4: Kin = 1, Kout = 2. 0 1 2 3 fill A1in (free slots).
    # 4: |A1in| = 4 > Kin -> 0 out, id to A1out [0].
    # 0: remembered in A1out -> to Am; room: 1 out, A1out [0 1] -> [1] once 0 leaves it.
    # 5: 2 out, A1out [1 2].  0 hit in Am.
    # 1: remembered; room: 3 out, A1out [1 2 3] trimmed to Kout = 2 by dropping 1 itself;
    #    the decision was made at the request, so 1 still goes to Am.
    # 6: |A1in| = 2 (4 5) > 1 -> 4 out; A1out [2 3 4] trimmed to [3 4]: 2 is forgotten.
    # 2: not remembered -> A1in again; room: 5 out.
    seq = [0, 1, 2, 3, 4, 0, 5, 0, 1, 6, 2]
    assert _evictions("2q", seq, 4) == [0, 1, 2, 3, 4, 5]
    tr = _trace(seq)
    pol = make_policy("2q", 4, tr.n_unique)
    assert simulate(pol, tr, None) == 1
    assert pol.q.to_array(1).tolist() == [0, 1] and pol.q.to_array(0).tolist() == [6, 2]


def test_gdsf_is_lfu_with_dynamic_aging():
    # cap 2, H = L + freq. 0 (H1) 0 hit (H2) 1 (H1).
    # 2: evict 1 (H1), L = 1; 2 gets H = 2.   1: tie at H2 -> the older, 0; L = 2; 1 gets H3.
    # 3: evict 2 (H2); 3 gets H3.   1 hit: H = 2 + 2 = 4.   0: evict 3 (H3), L = 3; 0 gets H4.
    # 2: tie at H4 -> the older, 1; L = 4.  Aging lets new blocks displace once-frequent ones.
    seq = [0, 0, 1, 2, 1, 3, 1, 0, 2]
    assert _evictions("gdsf", seq, 2) == [1, 0, 2, 3, 1]
    tr = _trace(seq)
    pol = make_policy("gdsf", 2, tr.n_unique)
    assert simulate(pol, tr, None) == 2 and pol.L == 4.0


def test_lhd_evicts_the_lowest_hit_density():
    # before any reconfiguration density is (class + 1) / (age + 1); ages here are all 0 after
    # coarsening, so a block hit at a short age (class 15) outranks never-hit ones (class 0).
    # cap 2: 0 0 1 -> {0 (hit), 1}; 2 evicts 1; 3 evicts 2; 0 and 3 hit. LRU: 2 hits.
    seq = [0, 0, 1, 2, 3, 0, 3]
    assert _evictions("lhd", seq, 2) == [1, 2]
    assert _hits("lhd", seq, 2) == 3 and _hits("lru", seq, 2) == 2


def test_lhd_density_model():
    pol = make_policy("lhd", 4, 16)
    pol.hits[3, 5] = 10
    pol.evictions[3, 8] = 10
    pol._reconfigure()  # decayed to 9 and 9: hits above age 0 = 9; lifetime = 6 x 18 + 3 x 9
    assert pol.density[3, 0] == pytest.approx(9 / 135)
    assert pol.density[3, 6] == 0.0 and pol.density[4, 0] == 0.0


def test_lirs_after_a_removal_evicts_only_residents():
    """The mechanism removes the only LIR block; a hit on the resident HIR block then made it
    the bottom of an S with no LIR under it, an eviction left it there as a ghost, and the
    next LIR promotion queued that ghost as resident: ``evict`` returned a block not held.
    With room in the LIR set the hit makes it LIR, as insert's warm-up does."""
    p = make_policy("lirs", 2, 16)
    resident: set[int] = set()

    def access(b: int) -> None:
        p.observe(b, 0.0, 0)
        if b in resident:
            p.on_hit(b, 0.0, 0, -1)
            return
        if p.size >= p.capacity:
            v = p.evict(0.0)
            assert v in resident, (b, v, sorted(resident))
            resident.discard(v)
        p.insert(b, 0.0, 0, -1)
        resident.add(b)

    access(1), access(2)  # 1 LIR, 2 resident HIR
    p.remove(1)
    resident.discard(1)
    for b in (2, 3, 5, 5, 6, 7, 2, 8):
        access(b)
    assert p.size == len(resident) == 2 and p.n_lir <= p.l_lirs
