"""The slab layout (groups of 512 slots: headers packed, payloads aligned after them)
and the write order it needs: a slot's header lands only after its payload did."""

import os
import struct

import numpy as np
import pytest

from kvtier.kernels.checksum import block_checksum
from kvtier.tiers.aligned import PageCache, aligned_empty
from kvtier.tiers.faults import FaultyBackend
from kvtier.tiers.io_backends import PosixBackend
from kvtier.tiers.nvme import NvmeStore
from kvtier.tiers.slab_layout import GROUP, HEADER_BYTES, HEADER_SPAN, SlabLayout, payload_align, slots_in_slab
from kvtier.tiers.slot_header import MAGIC, decode_header, header_place, pack_header, pack_headers

from ..conftest import pattern, sealed_blocks


@pytest.fixture
def posix():
    be = PosixBackend(threads=2)
    yield be
    be.shutdown()


@pytest.mark.parametrize("stride, align", [(256 << 10, 256 << 10), (20480, 4096), (8 << 20, 2 << 20),
                                           (12288, 4096), (2 << 20, 2 << 20)])
def test_payloads_are_aligned_after_their_groups_packed_headers(stride, align):
    per_file = GROUP + 3  # a full group and a partial one per file
    layout = SlabLayout(2 * per_file + 5, stride, per_file)  # files of 515, 515 and 5 slots
    assert payload_align(stride) == layout.align == align
    spans = []
    for slot in range(layout.n_slots):
        f, hdr = layout.header_offset(slot)
        g, pay = layout.payload_offset(slot)
        group, j = divmod(slot % per_file, GROUP)
        assert f == g == slot // per_file
        assert hdr == group * layout.group_bytes + j * HEADER_BYTES  # packed, slot after slot
        assert pay % align == 0 and pay >= group * layout.group_bytes + HEADER_SPAN  # after its group's headers
        assert pay + stride <= layout.file_bytes(f)
        spans.append((f, hdr, HEADER_BYTES))
        spans.append((f, pay, stride))
    for f in range(3):  # no two slots' bytes overlap, in any file
        mine = sorted((o, o + n) for ff, o, n in spans if ff == f)
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(mine, mine[1:]))
    assert [slots_in_slab(layout.file_bytes(f), stride) for f in range(3)] == [515, 515, 5]
    assert layout.starts_header_run(GROUP) and layout.starts_header_run(per_file) and not layout.starts_header_run(7)
    with pytest.raises(ValueError):
        layout.payload_offset(layout.n_slots)
    with pytest.raises(ValueError):
        slots_in_slab(layout.file_bytes(0) + 4096, stride)


def test_a_slots_offsets_do_not_depend_on_the_tier_size():
    """A restart with more or fewer NVMe slots must find every kept slot where it was."""
    small, large = SlabLayout(40, 8192, 1000), SlabLayout(5000, 8192, 1000)
    for slot in range(40):
        assert small.header_offset(slot) == large.header_offset(slot)
        assert small.payload_offset(slot) == large.payload_offset(slot)


def test_recovered_blocks_read_back_after_the_nvme_tier_grows_or_shrinks(nvme_dir):
    """Blocks sealed on NVMe, then restarts with a larger and a smaller NVMe tier: every
    block that still has its slot is recovered and reads back with its bytes."""
    from kvtier.tiers.manager import TierManager
    from kvtier.tiers.types import Tier

    bb = 8192
    m = TierManager(bb, 4, 4, 8, nvme_dir=nvme_dir, io_backend="posix")
    blocks = sealed_blocks(m, 4, bb, key0=100)
    m.demote(blocks, "hbm", "nvme"); m.wait()
    m.close()
    for nvme_slots in (64, 8):  # the clean stop's index names other geometry: each start scans the headers
        m = TierManager(bb, 4, 4, nvme_slots, nvme_dir=nvme_dir, io_backend="posix", recover_payloads=False)
        try:
            assert m.recovered == 4 and m.discarded == 0
            back = [b for b in range(m.table.max_blocks) if m.table.has_copy(b, Tier.NVME)]
            m.promote(back, "hbm"); m.wait()
            assert not m.last_errors
            assert sorted((int(m.table.key[b]), m.read(b)) for b in back) == [
                (100 + i, pattern(i, bb).tobytes()) for i in range(4)]
        finally:
            m.close()


def test_slab_bytes_lie_where_the_layout_says(posix, nvme_dir):
    """Read back with plain file I/O: every header at its packed offset, every payload at its aligned one."""
    st = NvmeStore(nvme_dir, 6, 8192, posix, slots_per_file=3)
    items = [(s, pattern(s, 8192), 700 + s, 8192, 11 * s, True, 3 + s) for s in (4, 0, 5, 2)]
    assert st.write_many(items).result() == [None] * 4
    layout = st.layout
    st.close()
    for s in (0, 2, 4, 5):
        f, hdr = layout.header_offset(s)
        _, pay = layout.payload_offset(s)
        with open(os.path.join(nvme_dir, f"slab-{f:04d}.kvt"), "rb") as fh:
            fh.seek(hdr)
            h = decode_header(np.frombuffer(fh.read(HEADER_BYTES), dtype=np.uint8), st.mac_key, st.place(s))
            fh.seek(pay)
            body = np.frombuffer(fh.read(8192), dtype=np.uint8)
        assert h is not None and (h.key, h.checksum, h.seq) == (700 + s, 11 * s, 3 + s)
        assert np.array_equal(body, pattern(s, 8192))
    for s in (1, 3):  # never written: zero header pages
        f, hdr = layout.header_offset(s)
        with open(os.path.join(nvme_dir, f"slab-{f:04d}.kvt"), "rb") as fh:
            fh.seek(hdr)
            assert not any(fh.read(HEADER_BYTES))


class _CountingFaults(FaultyBackend):
    """Fails the first ``fail_writes`` writes (as FaultyBackend) and records every write's offset."""

    def __init__(self, inner, **kw):
        super().__init__(inner, **kw)
        self.writes = []

    def pwrite(self, handle, buffers, offset):
        self.writes.append((offset, sum(b.nbytes for b in buffers)))
        return super().pwrite(handle, buffers, offset)


def test_a_failed_payload_keeps_its_old_header_and_splits_the_header_run(posix, nvme_dir):
    """Payloads go first, in slot order; then one header write per run of consecutive
    slots whose payloads landed. The slot whose payload failed keeps the header it had
    (its older block stays what recovery would find), and its neighbours' headers land."""
    st = NvmeStore(nvme_dir, 8, 4096, posix, slots_per_file=8)
    old = pattern(90, 4096)
    st.write(3, old, key=33, length=4096, checksum=block_checksum(old), sealed=True).result()
    be = _CountingFaults(posix, fail_writes=1, mode="eio")
    st.backend = be
    items = [(s, pattern(s, 4096), 100 + s, 4096, block_checksum(pattern(s, 4096)), True, 50 + s) for s in (5, 3, 4, 6)]
    errors = st.write_many(items).result()
    assert [e is None for e in errors] == [True, False, True, True]  # slot 3 (the first payload) failed
    payloads = [st.layout.payload_offset(s)[1] for s in (3, 4, 5, 6)]
    assert be.writes[:4] == [(off, 4096) for off in payloads]
    assert be.writes[4:] == [(st.layout.header_offset(4)[1], 3 * HEADER_BYTES)]  # one run: slots 4-6
    st.backend = posix
    h3 = st.read_header(3)
    assert h3 is not None and h3.key == 33  # the old block's header, untouched
    assert [st.read_header(s).key for s in (4, 5, 6)] == [104, 105, 106]
    found, discarded = st.recover()
    # the failed write moved no byte (EIO before any): slot 3 still holds key 33, whole
    assert [(r.slot, r.header.key) for r in found] == [(3, 33), (4, 104), (5, 105), (6, 106)] and discarded == 0
    st.close()


def test_slabs_of_the_previous_layout_are_discarded_cleanly(posix, nvme_dir):
    """A slab of layout version 2 (a header page in front of each payload) recovers as
    empty, raises nothing, is counted as discarded once (not at every start), and its
    slots take new blocks that recover."""
    stride, n = 8192, 4
    raw = np.zeros(n * (HEADER_BYTES + stride), dtype=np.uint8)
    head = struct.Struct("<8sIIQQQQ")
    for s in range(n):
        at = s * (HEADER_BYTES + stride)
        head.pack_into(raw, at, MAGIC, 2, 1, 40 + s, stride, 0, s + 1)
        raw[at + HEADER_BYTES: at + HEADER_BYTES + stride] = pattern(s, stride)
    with open(os.path.join(nvme_dir, "slab-0000.kvt"), "wb") as f:
        f.write(raw.tobytes())
    st = NvmeStore(nvme_dir, n, stride, posix, slots_per_file=n)
    try:
        found, discarded = st.recover()
        assert found == [] and st.unreadable == 0 and discarded > 0
        for verify in (True, False):  # the old bytes where headers go were zeroed: not counted again
            assert st.recover(verify_payload=verify) == ([], 0)
        data = pattern(7, stride)
        st.write(2, data, key=99, length=stride, checksum=block_checksum(data), sealed=True).result()
        found, _ = st.recover()
        assert [(r.slot, r.header.key) for r in found] == [(2, 99)]
        out = aligned_empty(stride)
        st.read(2, out).result()
        assert np.array_equal(out, data)
    finally:
        st.close()


def test_a_header_run_ends_at_a_group_boundary(posix, nvme_dir):
    """Consecutive slots across a group boundary: their headers are not contiguous on
    disk, so they go as two writes, and each lands in its own group."""
    be = _CountingFaults(posix)
    st = NvmeStore(nvme_dir, GROUP + 2, 4096, be, slots_per_file=GROUP + 2)
    slots = [GROUP - 2, GROUP - 1, GROUP, GROUP + 1]
    items = [(s, pattern(s, 4096), 10 + s, 4096, 0, True, 1 + s) for s in slots]
    assert st.write_many(items).result() == [None] * 4
    hdrs = be.writes[4:]
    assert hdrs == [(st.layout.header_offset(GROUP - 2)[1], 2 * HEADER_BYTES),
                    (st.layout.header_offset(GROUP)[1], 2 * HEADER_BYTES)]
    assert [st.read_header(s).key for s in slots] == [10 + s for s in slots]
    found, _ = st.recover(verify_payload=False)
    assert [r.slot for r in found] == slots
    st.close()


def test_a_slot_named_twice_in_a_batch_is_refused_before_any_io(posix, nvme_dir):
    be = _CountingFaults(posix)
    st = NvmeStore(nvme_dir, 4, 4096, be, slots_per_file=4)
    with pytest.raises(ValueError, match="named twice"):
        st.write_many([(1, pattern(1, 4096), 1, 4096, 0, True, 1), (1, pattern(2, 4096), 2, 4096, 0, True, 2)])
    assert be.writes == []
    st.close()


def test_a_short_write_tears_a_payload_and_never_blocks_an_io_thread(nvme_dir):
    """The fault injector's short write lands half the payload for real and fails the
    write without waiting on its pool: with one I/O thread the batch still completes,
    the torn slot keeps its old header, and the other slot lands whole."""
    inner = PosixBackend(threads=1)
    try:
        st = NvmeStore(nvme_dir, 2, 8192, inner, slots_per_file=2)
        st.backend = FaultyBackend(inner, fail_writes=1, mode="short")
        errors = st.write_many([(0, pattern(0, 8192), 5, 8192, 0, True, 1),
                                (1, pattern(1, 8192), 6, 8192, 0, True, 2)]).result(timeout=10)
        assert errors[0] is not None and "short write" in str(errors[0]) and errors[1] is None
        st.backend = inner
        out = aligned_empty(8192)
        st.read(0, out).result()
        assert np.array_equal(out[:4096], pattern(0, 8192)[:4096]) and not out[4096:].any()  # half landed
        assert st.read_header(0) is None and st.read_header(1).key == 6
        st.close()
    finally:
        inner.shutdown()


def test_a_header_garbled_in_flight_is_skipped_not_erased(posix, nvme_dir):
    """A scan whose read of the headers came back with a flipped byte skips that slot,
    but the header on disk is good: it reads back otherwise, is not zeroed, and the
    next start recovers the slot."""
    st = NvmeStore(nvme_dir, 4, 8192, posix, slots_per_file=4)
    for s in range(4):
        st.write(s, pattern(s, 8192), key=20 + s, length=8192, checksum=0, sealed=True).result()
    st.backend = FaultyBackend(posix, corrupt_reads=1)  # flips byte 17 of the first read: slot 0's header
    found, discarded = st.recover(verify_payload=False)
    assert [r.slot for r in found] == [1, 2, 3] and discarded == 1
    st.backend = posix
    found, discarded = st.recover(verify_payload=False)
    assert [r.slot for r in found] == [0, 1, 2, 3] and discarded == 0
    st.close()


def test_a_newer_versions_header_is_skipped_and_left_alone(posix, nvme_dir, monkeypatch):
    """Rolling back to this version must not erase what a newer one wrote."""
    import kvtier.tiers.slot_header as slot_header

    st = NvmeStore(nvme_dir, 2, 4096, posix, slots_per_file=2)
    monkeypatch.setattr(slot_header, "VERSION", slot_header.VERSION + 1)
    st.write(0, pattern(0, 4096), key=1, length=4096, checksum=0, sealed=True).result()
    monkeypatch.undo()
    for _ in range(2):
        found, discarded = st.recover(verify_payload=False)
        assert found == [] and discarded == 1  # skipped each time: it is still there
    st.close()


# the array forms the batched path uses (nvme_batch), against their scalar forms
def test_pack_headers_packs_what_pack_header_does():
    rng = np.random.default_rng(7)
    n, key = 300, os.urandom(32)
    fields = {"key": rng.integers(0, 2**63, n, dtype=np.uint64) * 2 + 1, "length": rng.integers(0, 1 << 20, n),
              "checksum": rng.integers(0, 2**63, n, dtype=np.uint64), "seq": rng.integers(0, 1 << 40, n),
              "flags": rng.integers(0, 2, n), "owner": rng.integers(0, 1 << 32, n)}
    slots = rng.integers(0, 1 << 20, n)
    many, one = np.zeros((n, HEADER_BYTES), np.uint8), np.zeros((n, HEADER_BYTES), np.uint8)
    pack_headers(many, fields, key, slots, 262144, 65536)
    for i in range(n):
        pack_header(one[i].data, *(int(fields[k][i]) for k in ("key", "length", "checksum", "seq", "flags", "owner")),
                    key, header_place(int(slots[i]), 262144, 65536))
    assert np.array_equal(many, one)


def test_vector_offsets_and_run_breaks_match_the_scalar_layout():
    per_file = GROUP + 6  # a full group and a partial one a file: runs break at groups and files
    layout = SlabLayout(3 * per_file, 8192, per_file)
    slots = np.arange(layout.n_slots)
    files, offsets = layout.payload_offsets(slots)
    assert [(int(f), int(o)) for f, o in zip(files, offsets)] == [layout.payload_offset(int(s)) for s in slots]
    pick = np.array([0, 1, 2, 5, GROUP - 1, GROUP, GROUP + 1, per_file - 1, per_file, per_file + 1])
    want = [True] + [bool(b != a + 1 or layout.starts_header_run(int(b))) for a, b in zip(pick, pick[1:])]
    assert layout.header_run_breaks(pick).tolist() == want
    with pytest.raises(ValueError, match="out of range"):
        layout.payload_offsets(np.array([0, layout.n_slots]))


def test_page_cache_reuses_buffers_and_keeps_the_bytes_outside_headers_zero():
    cache = PageCache(4096, keep_pages=8)
    a = cache.take(3)
    assert a.shape == (3, 4096) and not a.any() and a.__array_interface__["data"][0] % 4096 == 0
    a[:, :64] = 7  # a user writes headers only
    cache.give(a)
    assert cache.cached_pages == 4  # 3 pages come from a buffer of 4
    b = cache.take(4)
    assert b.__array_interface__["data"][0] == a.__array_interface__["data"][0] and not b[:, 64:].any()
    cache.give(b, reuse=False)  # a batch that failed part-way: not reused
    assert cache.cached_pages == 0
    with pytest.raises(ValueError, match="not taken"):
        cache.give(b)  # given back already
    big = cache.take(9)  # 16 pages: over what the cache keeps
    cache.give(big)
    assert cache.cached_pages == 0
    c, d = cache.take(1), cache.take(1)
    cache.give(c)
    cache.give(d)
    assert cache.cached_pages == 2
