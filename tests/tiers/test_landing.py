"""The compiled landing of a memory copy does to the block table exactly what numpy does,
and refuses (changing nothing) an input that would send it outside an array."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from kvtier.tiers import landing
from kvtier.tiers.manager import TierManager
from kvtier.tiers.types import DRAM, HBM, Tier

pytestmark = pytest.mark.skipif(landing._c_land is None, reason="the compiled landing (kernels/_land.c) was not built")
BB = 4096


def _state(t, extra: tuple[np.ndarray, ...]) -> list[np.ndarray]:
    lists = [a for lst in (*t.free_slots, t.free_blocks, t.nvme_idle) for a in (lst.next, lst.prev, lst.owner, lst.lengths)]
    return [t.busy, t.copies, t.slot, *t.slot_owner, *lists, *extra]


def _args(m: TierManager, t) -> tuple:
    return (t, t.extra["inflight_tid"], t.extra["io_failures"], m.hbm_slot_ns, t.extra["namespace"])


def _pending_move(m: TierManager, rng: np.random.Generator):
    """A move submitted and copied but not applied: its pending record."""
    t = m.table
    hbm_only, dram_only = (np.flatnonzero((t.copies == c) & (t.busy == 0)) for c in (0b001, 0b010))
    if dram_only.size == 0 or (hbm_only.size and rng.random() < 0.5):
        blocks = rng.permutation(hbm_only)[: rng.integers(1, 12)]
        tid = m.demote(blocks, Tier.HBM, Tier.DRAM, keep_source=bool(rng.random() < 0.3))
    else:
        blocks = rng.permutation(dram_only)[: rng.integers(1, 12)]
        tid = m.promote(blocks, Tier.HBM)
    assert tid and tid > 0
    m.mover.drain()
    return m._pending[tid]


@pytest.mark.parametrize("seed", range(8))
def test_compiled_landing_matches_numpy_column_by_column(seed):
    """Random tables and moves (demotions dropping or keeping the source, promotions, scattered
    slots after churn): the kernel leaves every column and free list as numpy does, and the
    manager's own apply through it keeps the table's invariants."""
    rng = np.random.default_rng(seed)
    m = TierManager(BB, 40, 40, 0)
    try:
        blocks = m.alloc(36)
        for i, b in enumerate(blocks.tolist()):
            m.write(b, np.full(BB, i, np.uint8))
            m.seal(b, 100 + i)
        m.demote(rng.permutation(blocks)[:18], Tier.HBM, Tier.DRAM)  # scattered slots from here on
        m.wait()
        for _ in range(6):
            p = _pending_move(m, rng)
            m.table.extra["io_failures"][:] = rng.integers(0, 3, m.table.max_blocks)  # earlier failed reads
            t_np, t_c = copy.deepcopy(m.table), copy.deepcopy(m.table)
            ns_np, ns_c = m.hbm_slot_ns.copy(), m.hbm_slot_ns.copy()
            owners = rng.integers(0, 4, m.table.max_blocks).astype(np.uint16)  # (on the copies only)
            t_np.extra["namespace"][:] = t_c.extra["namespace"][:] = owners
            got = [fn(t, t.extra["inflight_tid"], t.extra["io_failures"], ns, t.extra["namespace"], p.blocks,
                      p.keep_source, int(p.src), int(p.dst))
                   for fn, t, ns in ((landing.land_numpy, t_np, ns_np), (landing.land, t_c, ns_c))]
            assert np.array_equal(got[0], got[1])
            for x, y in zip(_state(t_np, (t_np.extra["inflight_tid"], t_np.extra["io_failures"], ns_np)),
                            _state(t_c, (t_c.extra["inflight_tid"], t_c.extra["io_failures"], ns_c))):
                assert np.array_equal(x, y)
            m.wait()  # the real apply (through the kernel)
            m.check_invariants()
            for b in np.flatnonzero(m.table.copies == 0b011)[:3].tolist():
                m.drop_copy(b, Tier.DRAM)  # churn: DRAM slots back to the free list out of order
        m.promote(np.flatnonzero(m.table.copies == 0b010), Tier.HBM)
        m.wait()
        for i, b in enumerate(blocks.tolist()):  # every block's bytes where the table says
            slot = m.pin(b)
            assert (m.hbm.host_view(slot)[:BB] == i).all(), b
            m.unpin(b)
    finally:
        m.close()


def test_compiled_landing_refuses_what_would_stray_and_changes_nothing():
    """A block outside the table or not moving, lengths that differ, a column of another type,
    a source slot missing or already free: each refused before any column changes."""
    m = TierManager(BB, 8, 8, 0)
    try:
        blocks = m.alloc(4)
        for i, b in enumerate(blocks.tolist()):
            m.seal(b, 200 + i)
        m.demote(blocks[:2], Tier.HBM, Tier.DRAM)
        m.mover.drain()
        t = m.table
        moving = blocks[:2].astype(np.int64)
        drop = np.zeros(2, bool)
        args = _args(m, t)
        before = [a.copy() for a in _state(t, (args[1], args[2], m.hbm_slot_ns))]
        bad_cases = [
            (np.array([moving[0], t.max_blocks]), drop, ValueError, "outside the table"),
            (np.array([moving[0], blocks[3]]), drop, ValueError, "not moving"),  # idle block
            (moving, np.zeros(3, bool), ValueError, "another length"),
        ]
        for blks, keep, exc, match in bad_cases:
            with pytest.raises(exc, match=match):
                landing._c_land(blks.astype(np.int64), keep, HBM, DRAM, t.busy, args[1], t.copies, args[2],
                                t.slot[HBM], t.slot_owner[HBM], t.free_slots[HBM].next, t.free_slots[HBM].prev,
                                t.free_slots[HBM].owner, t.free_slots[HBM].lengths, None, None, None)
        with pytest.raises(TypeError, match="busy"):
            landing._c_land(moving, drop, HBM, DRAM, t.busy.astype(np.int32), args[1], t.copies, args[2],
                            t.slot[HBM], t.slot_owner[HBM], t.free_slots[HBM].next, t.free_slots[HBM].prev,
                            t.free_slots[HBM].owner, t.free_slots[HBM].lengths, None, None, None)
        listed = t.free_slots[HBM].to_array()[:1]  # a free slot named as a block's source slot
        slot_row = t.slot[HBM].copy()
        slot_row[moving[1]] = listed[0]
        with pytest.raises(ValueError, match="on a free list already"):
            landing._c_land(moving, drop, HBM, DRAM, t.busy, args[1], t.copies, args[2], slot_row,
                            t.slot_owner[HBM], t.free_slots[HBM].next, t.free_slots[HBM].prev,
                            t.free_slots[HBM].owner, t.free_slots[HBM].lengths, None, None, None)
        slot_row[moving[1]] = -1
        with pytest.raises(ValueError, match="holds no source slot"):
            landing._c_land(moving, drop, HBM, DRAM, t.busy, args[1], t.copies, args[2], slot_row,
                            t.slot_owner[HBM], t.free_slots[HBM].next, t.free_slots[HBM].prev,
                            t.free_slots[HBM].owner, t.free_slots[HBM].lengths, None, None, None)
        free = t.free_slots[HBM]

        def call(blks=moving, keep=drop, copies=t.copies, failures=args[2], slot=t.slot[HBM], prev=free.prev):
            return landing._c_land(blks, keep, HBM, DRAM, t.busy, args[1], copies, failures, slot,
                                   t.slot_owner[HBM], free.next, prev, free.owner, free.lengths, None, None, None)

        twice = slot_row.copy()
        twice[moving[1]] = t.slot[HBM][moving[0]]
        bad_tail = free.prev.copy()
        bad_tail[-1] = 99
        for kwargs, match in [
            (dict(blks=moving[[0, 1, 0]], keep=np.zeros(3, bool)), "named twice"),  # a repeat: the marks undone
            (dict(slot=twice), "two blocks name one source slot"),
            (dict(failures=t.copies), "share memory"),  # one array as two columns
            (dict(prev=bad_tail), "tail is outside"),
        ]:
            with pytest.raises(ValueError, match=match):
                call(**kwargs)
        with pytest.raises(ValueError, match="named twice"):
            landing.land_numpy(*_args(m, t), moving[[0, 0]], np.zeros(2, bool), HBM, DRAM)
        for a, b in zip(before, _state(t, (args[1], args[2], m.hbm_slot_ns))):
            assert np.array_equal(a, b)
        m.wait()
        m.check_invariants()
        assert (t.copies[moving] == 0b010).all()
    finally:
        m.close()
