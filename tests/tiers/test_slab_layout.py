"""The slab layout (headers packed in front, payloads aligned after them) and the
write order it needs: a slot's header lands only after its payload did."""

import os
import struct

import numpy as np
import pytest

from kvtier.kernels.checksum import block_checksum
from kvtier.tiers.aligned import aligned_empty
from kvtier.tiers.faults import FaultyBackend
from kvtier.tiers.io_backends import PosixBackend
from kvtier.tiers.nvme import MAGIC, NvmeStore, decode_header
from kvtier.tiers.slab_layout import HEADER_BYTES, SlabLayout, payload_align, slots_in_slab

from ..conftest import pattern


@pytest.fixture
def posix():
    be = PosixBackend(threads=2)
    yield be
    be.shutdown()


@pytest.mark.parametrize("stride, align", [(256 << 10, 256 << 10), (20480, 4096), (8 << 20, 2 << 20),
                                           (12288, 4096), (2 << 20, 2 << 20)])
def test_payloads_are_aligned_to_their_stride_after_packed_headers(stride, align):
    layout = SlabLayout(10, stride, 4)  # files of 4, 4 and 2 slots
    assert payload_align(stride) == layout.align == align
    for slot in range(10):
        f, hdr = layout.header_offset(slot)
        g, pay = layout.payload_offset(slot)
        local = slot % 4
        assert f == g == slot // 4 and hdr == local * HEADER_BYTES
        assert pay % align == 0 and pay >= layout.count(f) * HEADER_BYTES  # after every header of its file
        assert pay + stride <= layout.file_bytes(f)
    assert [layout.file_bytes(f) for f in range(3)] == [layout.payload_base(c) + c * stride for c in (4, 4, 2)]
    assert [slots_in_slab(layout.file_bytes(f), stride) for f in range(3)] == [4, 4, 2]
    with pytest.raises(ValueError):
        layout.payload_offset(10)
    with pytest.raises(ValueError):
        slots_in_slab(layout.file_bytes(0) + 4096, stride)


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
            h = decode_header(np.frombuffer(fh.read(HEADER_BYTES), dtype=np.uint8))
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
    empty, raises nothing, and its slots take new blocks that recover."""
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
        for verify in (True, False):
            found, _ = st.recover(verify_payload=verify)
            assert found == [] and st.unreadable == 0
        data = pattern(7, stride)
        st.write(2, data, key=99, length=stride, checksum=block_checksum(data), sealed=True).result()
        found, _ = st.recover()
        assert [(r.slot, r.header.key) for r in found] == [(2, 99)]
        out = aligned_empty(stride)
        st.read(2, out).result()
        assert np.array_equal(out, data)
    finally:
        st.close()
