"""The compiled planning of a memory move's common case does to the block table what the
numpy path does, answers every request the same, and changes nothing where it declines or
refuses."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.tiers import planning
from kvtier.tiers.manager import TierManager
from kvtier.tiers.types import FREE, SEALED, Tier

pytestmark = pytest.mark.skipif(planning._c_plan is None, reason="the compiled planning (kernels/_plan.c) was not built")
BB = 4096
N = 40


def _columns(m: TierManager) -> list[np.ndarray]:
    t = m.table
    lists = [a for lst in (*t.free_slots, t.free_blocks, t.nvme_idle) for a in (lst.next, lst.prev, lst.owner, lst.lengths)]
    return [t.state, t.busy, t.pins, t.copies, t.slot, t.nbytes, *t.slot_owner, *lists, m.inflight]


def _pending(m: TierManager) -> list:
    return [(tid, p.blocks.tolist(), int(p.src), int(p.dst), p.keep_source.tolist(), p.chunks)
            for tid, p in sorted(m._pending.items())]


def _manager(sent: list) -> TierManager:
    """40 blocks, 32 of them sealed; DRAM has room for 24, so a move can find too few slots.
    Every transfer submitted is recorded in ``sent``."""
    m = TierManager(BB, 48, 24, 0)
    blocks = m.alloc(N)
    for i, b in enumerate(blocks.tolist()):
        m.write(b, np.full(BB, i, np.uint8))
        if i < 32:
            m.seal(b, 100 + i)
    submit = m.mover.submit

    def record(x):
        sent.append((x.tid, int(x.src), int(x.dst), x.blocks.tolist(), x.src_slots.tolist(), x.dst_slots.tolist(),
                     x.lengths.tolist(), x.keys, x.checksums, x.sealed, x.chunks))
        submit(x)

    m.mover.submit = record
    return m


def _request(rng: np.random.Generator, m: TierManager):
    """A random request, often the common case, often not: blocks not in the source tier,
    already in the destination, moving, pinned, named twice, out of range, open; lists and
    int32 arrays as well as int64 ones; too many for DRAM's free slots."""
    t = m.table
    live = np.flatnonzero(t.state != FREE)
    k = int(rng.integers(1, 14))
    kind = rng.random()
    if kind < 0.4:  # demote from HBM
        pool = np.flatnonzero(((t.copies & 1) != 0) & (t.busy == 0)) if rng.random() < 0.8 else live
    elif kind < 0.7:  # promote to HBM
        pool = np.flatnonzero((t.copies == 0b010) & (t.busy == 0)) if rng.random() < 0.8 else live
    else:
        pool = live
    blocks = rng.permutation(pool)[:k].astype(np.int64) if pool.size else np.zeros(0, np.int64)
    r = rng.random()
    if r < 0.05 and blocks.size:
        blocks = np.append(blocks, blocks[0])  # named twice
    elif r < 0.08:
        blocks = np.append(blocks, N + 50)  # outside the table
    form = rng.random()
    arg = blocks.tolist() if form < 0.1 else blocks.astype(np.int32) if form < 0.2 else blocks
    if kind < 0.4:
        keep = bool(rng.random() < 0.3)
        return lambda mm: mm.demote(arg, Tier.HBM, Tier.DRAM, keep_source=keep)
    if kind < 0.7:
        return lambda mm: mm.promote(arg, Tier.HBM)
    b = int(rng.choice(live))
    side = rng.random()
    if side < 0.2:
        return lambda mm: mm.pin(b)
    if side < 0.4:
        return lambda mm: mm.unpin(b)
    if side < 0.55:
        return lambda mm: mm.drop_copy(b, Tier.DRAM)
    if side < 0.8:  # DRAM slots back, out of order: the copies of blocks also in HBM
        both = rng.permutation(np.flatnonzero((t.copies == 0b011) & (t.busy == 0)))[:6].tolist()
        return lambda mm: [mm.drop_copy(x, Tier.DRAM) for x in both] and None
    return lambda mm: mm.wait()


def _answer(m: TierManager, fast: bool, request, planned: list) -> tuple:
    kernel = planning._c_plan

    def counted(*args):
        got = kernel(*args)
        planned.append(got is not None)
        return got

    planning._c_plan = counted if fast else None
    try:
        got = request(m)
        return ("ok", got if isinstance(got, (int, type(None))) else None)
    except Exception as e:  # the two paths must refuse alike
        return (type(e).__name__, str(e))
    finally:
        planning._c_plan = kernel


@pytest.mark.parametrize("seed", range(6))
def test_compiled_planning_matches_numpy_request_by_request(seed):
    rng = np.random.default_rng(seed)
    sent_np: list = []
    sent_c: list = []
    m_np, m_c = _manager(sent_np), _manager(sent_c)
    planned: list[bool] = []
    try:
        for step in range(400):
            request = _request(rng, m_np)
            a, b = _answer(m_np, False, request, planned), _answer(m_c, True, request, planned)
            assert a == b, (step, a, b)
            for x, y in zip(_columns(m_np), _columns(m_c)):
                assert np.array_equal(x, y), step
            assert _pending(m_np) == _pending(m_c), step
            assert sent_np == sent_c, step
            if rng.random() < 0.4:
                m_np.wait()
                m_c.wait()
                m_c.check_invariants()
        m_np.wait()
        m_c.wait()
        for i in range(N):  # every block's bytes where the table says, on the planned side
            tier = Tier.HBM if m_c.table.copies[i] & 1 else Tier.DRAM
            view = m_c.hbm.host_view if tier == Tier.HBM else m_c.dram.host_view
            assert (view(int(m_c.table.slot[int(tier), i]))[:BB] == i).all(), i
        # the history reached both of the kernel's answers, often
        assert sum(planned) > 40 and planned.count(False) > 20, (sum(planned), planned.count(False))
    finally:
        m_np.close()
        m_c.close()


def test_the_kernel_declines_or_refuses_and_changes_nothing():
    """Bad columns are refused (an error, nothing changed); a broken free list (a link out of
    range where the walk or the splice follows it, a loop) is an error with every mark undone;
    a block outside the common case is declined (None)."""
    m = _manager([])
    t = m.table
    try:
        free = t.free_slots[1]
        blocks = np.arange(4, dtype=np.int64)
        out = np.empty((3, 4), np.int64)
        keep = np.empty(4, bool)

        def call(blocks=blocks, tid=7, busy=t.busy, nxt=free.next, outs=(out[0], out[1], out[2]), src=0):
            return planning._c_plan(blocks, False, src, 1, tid, FREE, SEALED, t.state, t.copies, busy, t.pins, m.inflight,
                                    t.slot[src], t.slot[1], t.slot_owner[1], nxt, free.prev, free.owner,
                                    free.lengths, t.nbytes, *outs, keep)

        before = [c.copy() for c in _columns(m)]
        for kwargs, error in (({"tid": 0}, ValueError), ({"src": 1}, ValueError),
                              ({"busy": t.busy[:-1]}, ValueError), ({"outs": (out[0], out[1], out[1])}, ValueError),
                              ({"busy": t.copies}, ValueError), ({"blocks": blocks.astype(np.int32)}, TypeError)):
            with pytest.raises(error):
                call(**kwargs)
        front = free.sentinel(0)
        for at, to in ((front, 10_000), (3, 10_000), (3, -7), (1, 0)):  # its front, the entry after
            broken = free.next.copy()  # the four taken (whose link the splice rewrites), a loop
            broken[at] = to
            with pytest.raises(RuntimeError):
                call(nxt=broken)
        assert call(blocks=np.array([0, 1, 2, 1], np.int64)) is None  # named twice: declined
        t.pins[3] = 1
        assert call() is None  # a pinned block leaving HBM: declined (the numpy path refuses it)
        t.pins[3] = 0
        for x, y in zip(before, _columns(m)):
            assert np.array_equal(x, y)
        assert call() is False  # and the common case is planned: no block has an NVMe copy
        assert (t.busy[:4] == 1).all() and (m.inflight[:4] == 7).all() and (t.slot[1, :4] == out[1]).all()
    finally:
        m.close()


@pytest.mark.parametrize("form", ["array", "list"])  # the compiled plan, and the numpy one
def test_a_move_whose_submit_raises_leaves_the_table_as_it_was(form):
    """Nothing was submitted, so nothing stays taken: the destination slots go back to the
    front of their free list in order, the blocks are idle, and the move can be retried."""
    m = _manager([])
    try:
        submit = m.mover.submit

        def fail(x):
            raise KeyboardInterrupt  # (an interrupt at the worst moment, or a bug below submit)

        m.demote(np.arange(6, 10, dtype=np.int64), Tier.HBM, Tier.DRAM)  # DRAM's free list not in id order
        m.wait()
        blocks = np.array([3, 1, 2, 0], np.int64)
        before = [c.copy() for c in _columns(m)]
        m.mover.submit = fail
        for request in (lambda: m.demote(blocks if form == "array" else blocks.tolist(), Tier.HBM, Tier.DRAM),
                        lambda: m.promote(np.arange(6, 10) if form == "array" else [6, 7, 8, 9], Tier.HBM)):
            with pytest.raises(KeyboardInterrupt):
                request()
            for x, y in zip(before, _columns(m)):
                assert np.array_equal(x, y)
            assert not m._pending
        m.mover.submit = submit
        m.check_invariants()
        assert m.demote(blocks, Tier.HBM, Tier.DRAM) and m.promote(np.arange(6, 10), Tier.HBM)
        m.wait()
        m.check_invariants()
    finally:
        m.close()
