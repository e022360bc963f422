"""Clean-stop slot index: a clean restart reads one file, a crash or a bad index scans."""

from __future__ import annotations

import os

import pytest

from kvtier.tiers.faults import FaultyBackend
from kvtier.tiers.io_backends import PosixBackend
from kvtier.tiers.manager import TierManager
from kvtier.tiers.slot_index import INDEX_FILE
from kvtier.tiers.types import BlockState, Tier

from ..conftest import pattern

BB = 9000
NEVER = 10**9  # reads the fault injector would fail: any read at start fails


def _fill(nvme_dir: str, n: int = 5) -> None:
    """n sealed blocks on NVMe, one more open one, then a clean stop."""
    m = TierManager(BB, 8, 8, 16, nvme_dir=nvme_dir, io_backend="posix")
    blocks = m.alloc(n + 1)
    for i, b in enumerate(blocks.tolist()):
        m.write(b, pattern(i, BB))
        if i < n:
            m.seal(b, 700 + i)
    m.demote(blocks, "hbm", "nvme"); m.wait()
    assert not m.last_errors
    m.close()


def _reopen(nvme_dir: str, header_only: bool = True, fail_reads: int = NEVER,
            block_bytes: int = BB) -> tuple[TierManager, FaultyBackend]:
    fb = FaultyBackend(PosixBackend(threads=2), fail_reads=fail_reads, mode="eio")
    m = TierManager(block_bytes, 8, 8, 16, nvme_dir=nvme_dir, io_backend=fb, recover_payloads=not header_only)
    return m, fb


def _sealed(m: TierManager) -> dict[int, int]:
    t = m.table
    return {int(t.key[b]): b for b in range(t.max_blocks) if t.state[b] == BlockState.SEALED}


def test_clean_restart_reads_the_index_and_no_slot(nvme_dir):
    _fill(nvme_dir)
    assert os.path.exists(os.path.join(nvme_dir, INDEX_FILE))
    m, fb = _reopen(nvme_dir)
    try:
        assert fb.fail_reads == NEVER  # not one slot header was read
        assert m.recovered_from == "index" and m.recovered == 5
        assert not os.path.exists(os.path.join(nvme_dir, INDEX_FILE))  # taken: a crash now means a scan
        fb.fail_reads = 0
        back = _sealed(m)
        assert sorted(back) == [700 + i for i in range(5)]
        for key, b in back.items():
            assert m.table.copies[b] == 1 << Tier.NVME
            assert m.read(b) == pattern(key - 700, BB).tobytes()
        m.check_invariants()
        b = int(m.alloc(1)[0])  # new writes outrank every slot on disk
        m.write(b, pattern(99, BB))
        m.seal(b, 799)
        m.demote([b], "hbm", "nvme"); m.wait()
        assert m.nvme is not None and m.nvme.read_header(int(m.table.slot[Tier.NVME, b])).seq > 6
    finally:
        m.close()
    m, _ = _reopen(nvme_dir, fail_reads=0)  # the second clean stop wrote a fresh index
    try:
        assert m.recovered_from == "index" and sorted(_sealed(m)) == [*range(700, 705), 799]
    finally:
        m.close()


def test_a_crash_leaves_no_index_and_the_start_scans(nvme_dir):
    _fill(nvme_dir)
    os.unlink(os.path.join(nvme_dir, INDEX_FILE))  # what a SIGKILL leaves (tests/tiers/test_crash.py kills for real)
    m, _ = _reopen(nvme_dir, fail_reads=0)
    try:
        assert m.recovered_from == "scan" and m.recovered == 5
    finally:
        m.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "geometry", "payload_mode"])
def test_a_bad_or_unwanted_index_is_removed_and_the_start_scans(nvme_dir, damage):
    _fill(nvme_dir)
    path = os.path.join(nvme_dir, INDEX_FILE)
    raw = bytearray(open(path, "rb").read())
    if damage == "flip":
        raw[-3] ^= 0xFF
    elif damage == "truncate":
        raw = raw[:-8]
    open(path, "wb").write(bytes(raw))
    kw = {"header_only": damage != "payload_mode"}
    if damage == "geometry":
        # other slab geometry: the index no longer describes these files; the scan
        # reads the same slots under the new geometry and finds no valid slot
        kw["block_bytes"] = BB + 8192
    m, fb = _reopen(nvme_dir, fail_reads=0, **kw)
    try:
        assert m.recovered_from == "scan"
        assert not os.path.exists(path)
        if damage != "geometry":
            back = _sealed(m)
            assert sorted(back) == [700 + i for i in range(5)]
            for key, b in back.items():
                assert m.read(b) == pattern(key - 700, BB).tobytes()
        m.check_invariants()
    finally:
        m.close()


def test_a_start_that_ignores_the_disk_discards_the_index(nvme_dir):
    """recover=False overwrites the slabs: a crash of that run must not leave the
    old index to describe slots it rewrote."""
    _fill(nvme_dir)
    m = TierManager(BB, 8, 8, 16, nvme_dir=nvme_dir, io_backend="posix", recover=False)
    try:
        assert m.recovered == 0 and not os.path.exists(os.path.join(nvme_dir, INDEX_FILE))
    finally:
        m.close()
