"""The copy lane: copies begun at submit, copies queued behind a busy lane, and what a
poll returns while both kinds are in flight."""

import threading
import time

import numpy as np
import pytest

from kvtier.tiers import hostcopy
from kvtier.tiers.manager import TierManager
from kvtier.tiers.types import Tier

from ..conftest import pattern, sealed_blocks

BB = 9000


def _every_byte_in_place(m: TierManager, blocks: np.ndarray) -> None:
    for i, b in enumerate(blocks.tolist()):
        assert m.read(b) == pattern(i, BB).tobytes()
    m.check_invariants()


@pytest.mark.skipif(hostcopy._c_start_rows is None, reason="the compiled copy (kernels/_copy.c) was not built")
def test_copies_begun_at_submit_land_while_the_lane_worker_is_busy(nvme_dir):
    """A host copy of whole rows starts on the kernel's threads as it is submitted and
    needs no lane worker: it lands, and the owner's poll collects and applies it, while
    the copy lane's worker is held on an earlier (layer-wise) copy, which the worker
    still finishes and reports after. Every byte is exact."""
    m = TierManager(BB, 16, 16, 8, nvme_dir=nvme_dir)
    entered, release = threading.Event(), threading.Event()
    real_copy = m.mover.copy_rows

    def held_copy(dst, dst_idx, src, src_idx, sync=True):  # holds the layer-wise promotion
        entered.set()
        assert release.wait(10)
        real_copy(dst, dst_idx, src, src_idx, sync)

    try:
        blocks = sealed_blocks(m, 12, BB, key0=300)
        m.demote(blocks[10:], "hbm", "dram"); m.wait()
        m.mover.copy_rows = held_copy  # type: ignore[method-assign]
        layered = m.promote(blocks[10:], "hbm", chunks=2)
        assert entered.wait(10)
        early = m.demote(blocks[:6], "hbm", "dram")
        assert m.mover.in_flight == 2
        deadline, got = time.monotonic() + 10, []
        while not got and time.monotonic() < deadline:
            got = m.poll(timeout=0.01)
        assert [c.tid for c in got] == [early] and got[0].ok.all() and np.array_equal(got[0].blocks, blocks[:6])
        assert all(m.table.copies[b] == 1 << Tier.DRAM for b in blocks[:6].tolist())  # applied
        assert m.has_pending() and m.mover.in_flight == 1  # the layer-wise one, still held
        release.set()
        assert [c.tid for c in m.wait(timeout=10)] == [layered]
        _every_byte_in_place(m, blocks)
    finally:
        release.set()
        m.close()


def test_a_lane_completion_waiting_is_not_held_behind_a_started_copy(nvme_dir):
    """A poll that may wait returns a lane's completion already posted at once, though a copy
    begun at submit is still in flight (it once waited on that copy first)."""
    m = TierManager(BB, 16, 16, 8, nvme_dir=nvme_dir)
    copier = m.mover.host_copier
    landed = threading.Event()

    class SlowJob:  # a started copy that lands when the test says so (then copies for real)
        def __init__(self, args):
            self.args = args

        def done(self):
            return landed.is_set()

        def wait(self, seconds):
            return landed.wait(seconds)

        def join(self):
            copier.copy_rows(*self.args)
            return 0

    try:
        blocks = sealed_blocks(m, 4, BB, key0=400)
        copier.start_rows = lambda *args: SlowJob(args)  # type: ignore[method-assign]
        started = m.demote(blocks[:2], "hbm", "dram")
        lane = m.demote(blocks[2:], "hbm", "nvme")
        while m.mover.in_flight > 1:  # the lane's write has posted its completion
            time.sleep(0.005)
        t0 = time.monotonic()
        assert [c.tid for c in m.poll(timeout=2.0)] == [lane]
        assert time.monotonic() - t0 < 1.0
        landed.set()
        assert [c.tid for c in m.wait(timeout=10)] == [started]
        _every_byte_in_place(m, blocks)
    finally:
        landed.set()
        m.close()


def test_queued_copies_merge_and_each_descriptor_completes(nvme_dir):
    """Copies queued behind a busy copy lane run as one pass; a layer-wise promotion
    between them is never merged and keeps its place; every descriptor still gets
    its own completion with exactly its blocks, and every byte lands where it should."""
    m = TierManager(BB, 16, 16, 8, nvme_dir=nvme_dir)
    m.mover.start_early = False  # copies begun at submit run on their own (the next test)
    entered, release = threading.Event(), threading.Event()
    calls: list[int] = []
    real_copy = m.mover.copy_rows

    def held_copy(dst, dst_idx, src, src_idx):  # holds the first copy until the queue is full
        calls.append(int(dst_idx.size))
        if len(calls) == 1:
            entered.set()
            assert release.wait(10)
        real_copy(dst, dst_idx, src, src_idx)

    try:
        blocks = sealed_blocks(m, 12, BB, key0=200)
        m.demote(blocks[10:], "hbm", "dram"); m.wait()  # for the layer-wise promotion
        m.mover.copy_rows = held_copy  # type: ignore[method-assign]
        held = m.demote(blocks[:2], "hbm", "dram")
        assert entered.wait(10)
        queued = [m.demote(blocks[2:4], "hbm", "dram"), m.demote(blocks[4:6], "hbm", "dram"),
                  m.promote(blocks[10:], "hbm", chunks=2),
                  m.demote(blocks[6:8], "hbm", "dram"), m.demote(blocks[8:10], "hbm", "dram")]
        release.set()
        done = m.wait(timeout=10)
        # held (2), merged (2+2), layered promotion in two parts (2, 2), merged (2+2)
        assert calls == [2, 4, 2, 2, 4]
        assert [c.tid for c in done] == [held, *queued]
        expect = [blocks[:2], blocks[2:4], blocks[4:6], blocks[10:], blocks[6:8], blocks[8:10]]
        for c, want in zip(done, expect):
            assert np.array_equal(c.blocks, want) and c.ok.all() and c.nbytes == 2 * BB
        assert all(m.table.copies[b] == 1 << Tier.DRAM for b in blocks[:10].tolist())
        assert all(m.table.copies[b] == (1 << Tier.HBM) | (1 << Tier.DRAM) for b in blocks[10:].tolist())
        _every_byte_in_place(m, blocks)
    finally:
        release.set()
        m.close()
