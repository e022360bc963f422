import pytest

from kvtier.tiers.io_backends import PosixBackend
from kvtier.tiers.manager import TierManager
from kvtier.tiers.types import BlockState, Tier

from ..conftest import pattern
from kvtier.tiers.faults import FaultyBackend

BB = 9000


def _manager(nvme_dir, **faults) -> tuple[TierManager, FaultyBackend]:
    fb = FaultyBackend(PosixBackend(threads=2), **faults)
    return TierManager(BB, 4, 4, 8, nvme_dir=nvme_dir, io_backend=fb), fb


@pytest.mark.parametrize("mode", ["enospc", "eio", "short"])
def test_failed_write_loses_nothing(nvme_dir, mode):
    m, fb = _manager(nvme_dir, fail_writes=1, mode=mode)
    try:
        blocks = m.alloc(3)
        for i, b in enumerate(blocks.tolist()):
            m.write(b, pattern(i, BB))
        sealed = m.seal(int(blocks[0]), 77)
        m.demote(blocks, "hbm", "dram"); m.wait()
        m.demote(blocks, "dram", "nvme"); m.wait()
        failed = [b for b in blocks.tolist() if not m.table.has_copy(b, Tier.NVME)]
        assert len(failed) == 1 and failed[0] in m.last_errors
        b = failed[0]
        assert m.table.has_copy(b, Tier.DRAM)  # still valid where it was
        for i, x in enumerate(blocks.tolist()):
            assert m.read(x) == pattern(i, BB).tobytes()
        m.check_invariants()
        m.last_errors.clear()
        m.demote([b], "dram", "nvme"); m.wait()  # disk healthy again: retry works
        assert m.table.has_copy(b, Tier.NVME) and not m.last_errors
        assert m.table.state[sealed] == BlockState.SEALED
    finally:
        m.close()


def test_corrupt_read_is_never_served(nvme_dir):
    m, fb = _manager(nvme_dir)
    try:
        b = int(m.alloc(1)[0])
        m.write(b, pattern(1, BB))
        m.seal(b, 1)
        m.demote([b], "hbm", "nvme"); m.wait()
        fb.corrupt_reads = 1
        m.promote([b], "hbm"); m.wait()
        assert not m.table.has_copy(b, Tier.HBM)  # bad bytes never became valid
        assert "checksum" in m.last_errors[b]
        m.check_invariants()
        m.promote([b], "hbm"); m.wait()
        assert m.read(b) == pattern(1, BB).tobytes()
    finally:
        m.close()


def test_failed_read_keeps_block(nvme_dir):
    m, fb = _manager(nvme_dir, mode="eio")
    try:
        b = int(m.alloc(1)[0])
        m.write(b, pattern(2, BB))
        m.demote([b], "hbm", "nvme"); m.wait()
        fb.fail_reads = 1
        m.promote([b], "dram"); m.wait()
        assert m.table.copies[b] == 1 << Tier.NVME and b in m.last_errors
        assert m.read(b) == pattern(2, BB).tobytes()
        m.check_invariants()
    finally:
        m.close()


def test_promotion_does_not_wait_behind_a_slow_disk(nvme_dir):
    """Copies and NVMe I/O run in separate lanes: with every disk call stalled
    0.5 s and both I/O workers busy, a DRAM -> HBM promotion still completes (and
    with the right bytes) while the disk transfers are in flight."""
    m, fb = _manager(nvme_dir, delay_s=0.5)
    try:
        blocks = m.alloc(4)
        for i, b in enumerate(blocks.tolist()):
            m.write(b, pattern(i, BB))
            m.seal(b, 100 + i)
        m.demote(blocks, "hbm", "dram"); m.wait()
        m.demote(blocks[:2], "dram", "nvme", keep_source=True)  # two stalled disk transfers
        m.demote(blocks[2:3], "dram", "nvme", keep_source=True)
        m.promote(blocks[3:], "hbm")
        done = []
        while not done or done[-1].dst != Tier.HBM:
            done += m.poll(timeout=5.0)
        assert [c.dst for c in done] == [Tier.HBM]  # the copy finished first
        assert m.mover.in_flight == 2
        m.wait()
        assert all(m.table.has_copy(b, Tier.NVME) for b in blocks[:3].tolist())
        for i, b in enumerate(blocks.tolist()):
            assert m.read(b) == pattern(i, BB).tobytes()
        m.check_invariants()
    finally:
        m.close()
