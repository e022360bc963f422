"""Failed write-backs to NVMe: the victims stay eligible, and a failing disk is backed off.

A real TierManager (shared memory, slab files) and the daemon's Placement; the
disk fails through FaultyBackend. Before the fix, a victim whose NVMe write
failed had already left its policy and never came back, so after a tier's worth
of failures nothing was evictable until restart.
"""

from __future__ import annotations

from kvtier.daemon.placement import Placement
from kvtier.tiers.faults import FaultyBackend
from kvtier.tiers.io_backends import PosixBackend
from kvtier.tiers.manager import TierManager
from kvtier.tiers.types import BlockState, Tier

from ..conftest import pattern

BB = 8192
HBM, DRAM, NVME = int(Tier.HBM), int(Tier.DRAM), int(Tier.NVME)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _setup(nvme_dir: str, dram: int, fail_writes: int) -> tuple[TierManager, Placement, FaultyBackend, Clock]:
    clock = Clock()
    fb = FaultyBackend(PosixBackend(threads=2), fail_writes=fail_writes, mode="eio")
    m = TierManager(BB, 4, dram, 16, nvme_dir=nvme_dir, io_backend=fb, clock=clock)
    return m, Placement(m, "lru", {}, clock), fb, clock


def _fill(m: TierManager, p: Placement, n: int, tag0: int) -> list[int]:
    blocks = m.alloc(n)
    assert blocks is not None
    p.on_alloc(blocks, False)
    for i, b in enumerate(blocks.tolist()):
        m.write(b, pattern(tag0 + i, BB))
    return blocks.tolist()


def _hbm_members(p: Placement, m: TierManager) -> set[int]:
    return {b for b in range(m.table.max_blocks) if p.tracked[HBM, b]}


def test_failed_write_backs_return_to_the_policy_and_demotion_resumes(nvme_dir):
    m, p, fb, clock = _setup(nvme_dir, dram=0, fail_writes=4)  # two rounds of two failed writes
    try:
        blocks = _fill(m, p, 4, 0)  # open, live blocks: they can only be written back, never dropped
        pol = p.policies[HBM]
        backoff = m.nvme_backoff.base_s

        p.maintain(0.5, 0.5); m.wait()  # HBM over its watermark: two write-backs, both fail
        assert m.counters["errors_hbm->nvme"] == 2 and fb.fail_writes == 2
        assert _hbm_members(p, m) == set(blocks) and pol.size == 4  # the victims are back in their policy
        assert all(m.table.copies[b] == 1 << HBM for b in blocks)
        assert m.counters["nvme_write_backoffs"] == 1

        p.maintain(0.5, 0.5); m.wait()  # within the backoff: the disk is not touched again
        assert fb.fail_writes == 2 and m.counters["errors_hbm->nvme"] == 2
        assert m.counters["nvme_backoff_skips"] >= 1
        assert _hbm_members(p, m) == set(blocks) and pol.size == 4

        clock.now += backoff + 0.01  # backoff over: try again, fail again, back off twice as long
        p.maintain(0.5, 0.5); m.wait()
        assert fb.fail_writes == 0 and m.counters["errors_hbm->nvme"] == 4
        assert m.counters["nvme_write_backoffs"] == 2
        assert _hbm_members(p, m) == set(blocks) and pol.size == 4
        clock.now += backoff + 0.01
        assert p.make_room(HBM, 2) == 0  # still backing off (doubled)
        m.wait()
        assert fb.fail_writes == 0 and m.counters["errors_hbm->nvme"] == 4

        clock.now += 2 * backoff  # the disk has recovered: demotion works again
        p.maintain(0.5, 0.5); m.wait()
        on_nvme = [b for b in blocks if m.table.copies[b] == 1 << NVME]
        assert len(on_nvme) == 2 and m.table.free_slot_count(HBM) == 2
        assert m.counters["moves_hbm->nvme"] == 2 and m.counters["errors_hbm->nvme"] == 4
        assert _hbm_members(p, m) == set(blocks) - set(on_nvme)
        assert pol.size == 2

        more = _fill(m, p, 2, 10)  # HBM full again: the next write-backs succeed at once
        p.maintain(0.5, 0.5); m.wait()
        assert m.counters["moves_hbm->nvme"] == 4 and m.table.free_slot_count(HBM) == 2
        for i, b in enumerate(blocks):
            assert m.read(b) == pattern(i, BB).tobytes()
        for i, b in enumerate(more):
            assert m.read(b) == pattern(10 + i, BB).tobytes()
        m.check_invariants()
    finally:
        p.close()
        m.close()


def test_dram_demotion_and_drops_still_work_while_nvme_backs_off(nvme_dir):
    m, p, fb, clock = _setup(nvme_dir, dram=2, fail_writes=1000)  # the disk fails for good
    try:
        cached = _fill(m, p, 2, 0)  # sealed and freed: may be dropped
        for i, b in enumerate(cached):
            assert m.seal(b, 0xA0 + i) == b
            m.free(b)
        m.demote(cached, "hbm", "dram"); m.wait()
        live = _fill(m, p, 4, 20)
        # DRAM is full of cached blocks; HBM is full of live ones
        fails = fb.fail_writes
        assert p.make_room(HBM, 2) == 2  # HBM -> DRAM; DRAM makes room by writing back (fails) or dropping
        m.wait()
        assert fb.fail_writes < fails  # one write-back to NVMe was tried and failed ...
        members = {b for b in range(m.table.max_blocks) if p.tracked[DRAM, b]}
        for b in cached:
            state = m.table.state[b]
            assert state == BlockState.FREE or (m.table.copies[b] == 1 << DRAM and b in members)
        tried = fb.fail_writes
        assert p.make_room(HBM, 4) >= 2  # ... and, within the backoff, DRAM room comes from drops alone
        m.wait()
        assert fb.fail_writes == tried and m.counters["nvme_backoff_skips"] >= 1
        assert all(m.table.state[b] == BlockState.FREE for b in cached)
        assert sum(m.table.copies[b] == 1 << DRAM for b in live) == 2
        for i, b in enumerate(live):
            assert m.read(b) == pattern(20 + i, BB).tobytes()
        m.check_invariants()
    finally:
        p.close()
        m.close()
