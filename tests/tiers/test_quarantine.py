"""Quarantine is for bad disk copies, not for keys: a transient bad read is retried,
and a key whose block is really corrupt is taken over by the next correct seal."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvtier.tiers import io_backends
from kvtier.tiers.faults import FaultyBackend
from kvtier.tiers.io_backends import PosixBackend
from kvtier.tiers.manager import TierManager
from kvtier.tiers.types import BlockState, CorruptBlockError, Tier

from ..conftest import pattern
from .verify_spy import spy_verifications

BB = 9000
KEY = 0xC0FFEE


def _manager(nvme_dir: str, **faults) -> tuple[TierManager, FaultyBackend]:
    fb = FaultyBackend(PosixBackend(threads=2), **faults)
    return TierManager(BB, 4, 4, 8, nvme_dir=nvme_dir, io_backend=fb), fb


def _sealed_on_nvme(m: TierManager, tag: int, key: int) -> int:
    b = int(m.alloc(1)[0])
    m.write(b, pattern(tag, BB))
    assert m.seal(b, key) == b
    m.demote([b], "hbm", "nvme"); m.wait()
    assert m.table.copies[b] == 1 << Tier.NVME
    return b


def _flip_on_disk(m: TierManager, b: int) -> None:
    """Flip payload byte 17 of ``b``'s NVMe slot in the slab file: every read now fails."""
    assert m.nvme is not None
    slot = int(m.table.slot[Tier.NVME, b])
    path = os.path.join(m.nvme.directory, "slab-0000.kvt")
    with open(path, "r+b") as f:
        off = m.nvme.layout.payload_offset(slot)[1] + 17
        f.seek(off)
        byte = f.read(1)[0]
        f.seek(off)
        f.write(bytes([byte ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())


def test_one_corrupt_read_is_retried_and_served(nvme_dir):
    m, fb = _manager(nvme_dir)
    try:
        b = _sealed_on_nvme(m, 1, KEY)
        fb.corrupt_reads = 1  # a bit flipped in flight; the disk copy is fine
        m.promote([b], "hbm"); m.wait()
        assert m.table.copies[b] == (1 << Tier.HBM) | (1 << Tier.NVME)
        assert not m.corrupt[b] and b not in m.last_errors and m.io_failures[b] == 0
        assert m.counters["nvme_read_retries"] == 1 and m.counters["corrupt_copies"] == 0
        assert m.read(b) == pattern(1, BB).tobytes()
        assert m.lookup(KEY) == b
        m.check_invariants()
    finally:
        m.close()


def test_one_failed_read_is_retried_and_served(nvme_dir):
    m, fb = _manager(nvme_dir, mode="eio")
    try:
        b = _sealed_on_nvme(m, 2, KEY)
        fb.fail_reads = 1  # one transient EIO
        m.promote([b], "dram"); m.wait()
        assert m.table.copies[b] == (1 << Tier.DRAM) | (1 << Tier.NVME)
        assert b not in m.last_errors and m.io_failures[b] == 0
        assert m.counters["nvme_read_retries"] == 1
        assert m.read(b) == pattern(2, BB).tobytes()
        m.check_invariants()
    finally:
        m.close()


def test_one_corrupt_read_in_read_is_retried(nvme_dir):
    m, fb = _manager(nvme_dir)
    try:
        b = _sealed_on_nvme(m, 3, KEY)
        fb.corrupt_reads = 1
        assert m.read(b) == pattern(3, BB).tobytes()
    finally:
        m.close()


def test_read_verifies_an_open_blocks_written_back_copy(nvme_dir):
    """An open block written back to NVMe has the checksum its write-back computed: ``read``
    serves its bytes and refuses a corrupt copy, as promoting it does (it had returned
    the flipped bytes unverified)."""
    m, _ = _manager(nvme_dir)
    try:
        b = int(m.alloc(1)[0])
        m.write(b, pattern(6, BB))  # open, never sealed
        m.demote([b], "hbm", "nvme"); m.wait()
        assert m.table.copies[b] == 1 << Tier.NVME and m.table.state[b] == BlockState.OPEN
        assert m.read(b) == pattern(6, BB).tobytes()
        _flip_on_disk(m, b)
        with pytest.raises(CorruptBlockError, match=f"block {b}"):
            m.read(b)
        assert m.counters["nvme_read_retries"] == 1  # read again before it raised
        m.promote([b], "hbm"); m.wait()  # the same verdict on the promote path
        assert "checksum" in m.last_errors[b] and m.table.copies[b] == 1 << Tier.NVME
    finally:
        m.close()


def test_quarantined_key_is_taken_by_the_next_correct_seal(nvme_dir):
    m, fb = _manager(nvme_dir)
    try:
        bad = _sealed_on_nvme(m, 4, KEY)  # still referenced by its sequence
        _flip_on_disk(m, bad)
        m.promote([bad], "hbm"); m.wait()
        assert m.corrupt[bad] and "checksum" in m.last_errors[bad]
        assert m.table.copies[bad] == 1 << Tier.NVME  # never served, never valid in HBM
        assert m.counters["nvme_read_retries"] == 1 and m.counters["corrupt_copies"] == 1
        assert m.lookup(KEY) == -1  # a miss: the engine recomputes instead of waiting on bad bytes
        m.check_invariants()

        new = int(m.alloc(1)[0])
        m.write(new, pattern(5, BB))
        assert m.seal(new, KEY) == new  # not folded into the corrupt block
        assert m.lookup(KEY) == new and m.ref(KEY) == new
        assert m.table.state[new] == BlockState.SEALED and not m.corrupt[new]
        assert m.read(new) == pattern(5, BB).tobytes()
        m.check_invariants()

        m.free(bad)  # its last reference: cached, still corrupt; the key stays the new block's
        assert m.table.refcount[bad] == 0 and m.corrupt[bad] and m.lookup(KEY) == new
        m.check_invariants()
        m.drop(bad)  # as eviction would: dropping it must not unindex the new block's key
        assert m.table.state[bad] == BlockState.FREE and m.lookup(KEY) == new
        m.check_invariants()

        m.demote([new], "hbm", "nvme"); m.wait()
        assert m.read(new) == pattern(5, BB).tobytes()
    finally:
        m.close()
    m2 = TierManager(BB, 4, 4, 8, nvme_dir=nvme_dir, io_backend="posix")  # the index names the new copy only
    try:
        b = m2.lookup(KEY)
        assert b >= 0 and m2.read(b) == pattern(5, BB).tobytes()
        m2.check_invariants()
    finally:
        m2.close()


def test_cached_corrupt_block_is_replaced_and_its_index_entry_not_restored(nvme_dir):
    m, fb = _manager(nvme_dir)
    try:
        bad = _sealed_on_nvme(m, 6, KEY)
        m.free(bad)  # cached: nothing holds it
        _flip_on_disk(m, bad)
        m.promote([bad], "dram"); m.wait()
        assert m.corrupt[bad] and m.lookup(KEY) == -1
        new = int(m.alloc(1)[0])
        m.write(new, pattern(7, BB))
        assert m.seal(new, KEY) == new
        m.demote([new], "hbm", "nvme"); m.wait()
        m.check_invariants()
        assert np.array_equal(m._nvme_index()["slot"], [m.table.slot[Tier.NVME, new]])
    finally:
        m.close()
    m2 = TierManager(BB, 4, 4, 8, nvme_dir=nvme_dir, io_backend="posix")
    try:
        assert m2.recovered == 1
        assert m2.read(m2.lookup(KEY)) == pattern(7, BB).tobytes()
    finally:
        m2.close()


def test_corrupt_slab_byte_is_refused_by_the_io_thread_that_read_it(nvme_dir, monkeypatch):
    """A byte changed in a slab file under a real O_DIRECT posix backend: the promotion
    verifies every block on the I/O thread that read it (never on the mover's thread),
    refuses the corrupt one twice (the read and its retry), serves none of its bytes
    and quarantines it, while the other blocks of the same batch land bit-exact."""
    m = TierManager(BB, 4, 4, 8, nvme_dir=nvme_dir, io_backend="posix", io_threads=2)
    try:
        blocks = [_sealed_on_nvme(m, 30 + i, KEY + i) for i in range(3)]
        bad = blocks[1]
        _flip_on_disk(m, bad)
        where = spy_verifications(monkeypatch)
        m.promote(blocks, "hbm"); m.wait()
        monkeypatch.undo()
        assert len(where) == 4 and all(w.startswith("kvtier-io") for w in where)  # 3 reads + 1 retry
        assert where.in_c == (2 if io_backends._blockio is not None else 0)  # the good two, in the compiled loop
        assert not m.table.has_copy(bad, Tier.HBM) and "failed its checksum" in m.last_errors[bad]
        assert m.corrupt[bad] and m.lookup(KEY + 1) == -1 and m.counters["nvme_read_retries"] == 1
        for i, b in enumerate(blocks):
            if b != bad:
                assert m.table.has_copy(b, Tier.HBM) and m.read(b) == pattern(30 + i, BB).tobytes()
        m.check_invariants()
    finally:
        m.close()


def test_a_failed_promotion_s_bytes_are_zeroed_before_another_namespace_gets_the_slot(nvme_dir):
    """A read that fails its checksum has already landed (most of) its bytes in the HBM slot;
    the slot's owner was recorded for good reads only, so an engine of another namespace
    was handed that slot unzeroed: 4095 of 4096 bytes of the other tenant's block."""
    m = TierManager(BB, 2, 0, 8, nvme_dir=nvme_dir, io_backend="posix", io_threads=2)
    try:
        a = int(m.alloc(1, ns=1)[0])
        m.write(a, bytes([0x5A]) * BB)  # tenant 1's bytes
        m.seal(a, KEY)
        m.free(a)
        m.demote([a], "hbm", "nvme"); m.wait()
        for b in m.alloc(2, ns=2).tolist():  # tenant 2 takes (and zeroes) both HBM slots, then frees them
            m.free(b)
        _flip_on_disk(m, a)
        m.promote([a], "hbm"); m.wait()  # lands in an HBM slot, fails its checksum (twice)
        assert m.corrupt[a] and m.table.copies[a] == 1 << Tier.NVME
        for b in m.alloc(2, ns=2).tolist():
            assert not (m.hbm.host_view(int(m.table.slot[Tier.HBM, b])) == 0x5A).any()
        m.check_invariants()
    finally:
        m.close()
