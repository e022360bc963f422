"""One conformance suite for every NVMe I/O backend."""

import os

import numpy as np
import pytest

from kvtier.tiers.aligned import aligned_empty
from kvtier.tiers.io_backends import kvikio_status, select_backend
from kvtier.tiers.nvme import HEADER_BYTES, NvmeStore

from ..conftest import pattern, sealed_blocks
from .verify_spy import spy_verifications


def test_roundtrip_many_concurrent(backend, nvme_dir):
    st = NvmeStore(nvme_dir, 40, 20_000, backend, slots_per_file=16)  # 3 slab files
    futs = []
    for s in range(40):
        buf = aligned_empty(st.data_stride)
        buf[:20_000] = pattern(s, 20_000)
        futs.append(st.write(s, buf, key=1000 + s, length=20_000, checksum=s, sealed=True))
    assert all(f.result() == HEADER_BYTES + st.data_stride for f in futs)
    for s in reversed(range(40)):
        out = aligned_empty(st.data_stride)
        st.read(s, out).result()
        assert np.array_equal(out[:20_000], pattern(s, 20_000))
        h = st.read_header(s)
        assert h is not None and h.key == 1000 + s and h.length == 20_000 and h.sealed
    assert sorted(os.listdir(nvme_dir)) == ["header.key", "seq.floor", "slab-0000.kvt", "slab-0001.kvt", "slab-0002.kvt"]
    st.close()


def test_unaligned_source_is_bounced(backend, nvme_dir):
    st = NvmeStore(nvme_dir, 2, 5000, backend)
    raw = np.zeros(5001, dtype=np.uint8)[1:]  # misaligned on purpose
    raw[:] = pattern(9, 5000)
    st.write(1, raw, key=9, length=5000, checksum=0, sealed=True).result()
    out = aligned_empty(st.data_stride)
    st.read(1, out).result()
    assert np.array_equal(out[:5000], raw)
    st.close()


def test_host_tensor_payload(backend, nvme_dir):
    """A host torch tensor (an HBM slot on a CPU-only node) writes like its bytes."""
    import torch

    st = NvmeStore(nvme_dir, 2, 8192, backend)
    src = torch.from_numpy(pattern(4, 8192).copy())
    st.write(0, src, key=4, length=8192, checksum=0, sealed=True).result()
    out = aligned_empty(st.data_stride)
    st.read(0, out).result()
    assert np.array_equal(out, src.numpy())
    st.close()


def test_pread_many_fails_reads_one_by_one(backend, nvme_dir):
    """Batched small reads: each lands where asked; one past the end of the file
    fails alone and the others still complete."""
    st = NvmeStore(nvme_dir, 4, 4096, backend, slots_per_file=4)
    for s in range(4):
        st.write(s, pattern(s, 4096), key=s + 1, length=4096, checksum=0, sealed=True).result()
    handle, _ = st.payload_at(0)
    bufs = [aligned_empty(4096) for _ in range(5)]
    end = os.path.getsize(os.path.join(nvme_dir, "slab-0000.kvt"))
    offsets = [st.payload_at(3)[1], st.payload_at(0)[1], end + 4096, st.payload_at(2)[1], st.payload_at(1)[1]]
    errors = backend.pread_many(handle, list(zip(bufs, offsets))).result()
    assert [e is None for e in errors] == [True, True, False, True, True]
    for buf, slot in zip([bufs[0], bufs[1], bufs[3], bufs[4]], [3, 0, 2, 1]):
        assert np.array_equal(buf, pattern(slot, 4096))
    st.close()


def test_read_checked_verifies_on_the_io_threads(backend, nvme_dir, monkeypatch):
    """Verified batch reads: every payload lands, the checksums run on the backend's
    threads (not the caller's), and a slot whose bytes on disk no longer match its
    checksum, or whose read fails, fails alone with its own error."""
    import threading

    from kvtier.kernels.checksum import block_checksum
    from kvtier.tiers.types import CorruptBlockError

    st = NvmeStore(nvme_dir, 6, 5000, backend, slots_per_file=3)  # 2 slab files
    sums = {s: block_checksum(pattern(s, 5000)) for s in range(6)}
    for s in range(6):
        st.write(s, pattern(s, 5000), key=s + 1, length=5000, checksum=sums[s], sealed=True).result()
    with open(os.path.join(nvme_dir, "slab-0001.kvt"), "r+b") as f:  # slot 4: one byte changed on disk
        f.seek(st.payload_at(4)[1] + 4999)
        byte = f.read(1)[0]
        f.seek(st.payload_at(4)[1] + 4999)
        f.write(bytes([byte ^ 1]))
    where = spy_verifications(monkeypatch)
    order = [5, 4, 0, 2, 1]
    outs = [aligned_empty(st.data_stride) for _ in order]
    errors = st.read_checked([(s, out, 5000, sums[s]) for s, out in zip(order, outs)]).result()
    unchecked = st.read_checked([(4, outs[1], 5000, None)]).result()  # an open block's read: not verified
    monkeypatch.undo()
    assert [e is None for e in errors] == [True, False, True, True, True]
    assert isinstance(errors[1], CorruptBlockError) and "slot 4 failed its checksum" in str(errors[1])
    for s, out, err in zip(order, outs, errors):
        if err is None:
            assert np.array_equal(out[:5000], pattern(s, 5000))
    assert unchecked == [None] and len(where) == 5
    # the posix backend's good reads are verified in its compiled loop; the mismatch, by the store's check
    assert where.in_c == (4 if getattr(backend, "compiled", False) else 0)
    assert threading.current_thread().name not in where and all(w.startswith("kvtier-") for w in where)
    os.truncate(os.path.join(nvme_dir, "slab-0000.kvt"), st.payload_at(2)[1])  # slot 2 now past the end
    outs = [aligned_empty(st.data_stride) for _ in range(2)]
    errors = st.read_checked([(2, outs[0], 5000, sums[2]), (1, outs[1], 5000, sums[1])]).result()
    assert errors[0] is not None and not isinstance(errors[0], CorruptBlockError) and errors[1] is None
    assert np.array_equal(outs[1][:5000], pattern(1, 5000))
    st.close()


def test_batched_headers_are_whole_pages_of_one_header_each(backend, nvme_dir):
    """A batch's headers share one buffer: each slot's 4 KiB header page on disk holds
    its own header and zeros after it (no other slot's bytes, no stale memory)."""
    from kvtier.tiers.slot_header import _HDR, _HDR_CRC, decode_header

    st = NvmeStore(nvme_dir, 4, 4096, backend, slots_per_file=4)
    items = [(s, pattern(s, 4096), 500 + s, 4096 - s, 9 * s, s % 2 == 0, 40 + s, 7 << 60 | s) for s in (2, 0, 3)]
    assert st.write_many(items).result() == [None] * 3
    st.close()
    with open(os.path.join(nvme_dir, "slab-0000.kvt"), "rb") as f:
        raw = np.frombuffer(f.read(), dtype=np.uint8)
    headers = raw[: 4 * HEADER_BYTES].reshape(4, HEADER_BYTES)  # packed at the front, in slot order
    for s in (2, 0, 3):
        h = decode_header(headers[s], st.mac_key, st.place(s))
        assert h is not None and (h.key, h.length, h.checksum, h.seq, h.sealed, h.owner) == (
            500 + s, 4096 - s, 9 * s, 40 + s, s % 2 == 0, 7 << 60 | s)
        off = st.layout.payload_offset(s)[1]
        end = _HDR.size + _HDR_CRC.size
        assert not headers[s, end:].any() and np.array_equal(raw[off: off + 4096], pattern(s, 4096))
    assert not headers[1].any()  # slot 1 was not written: its header page is untouched


def test_write_many_lands_each_slot_and_fails_alone(backend, nvme_dir):
    """A batch of slot writes across slab files as one backend call: every slot reads back
    with its header; with injected faults the failed writes fail alone, in order."""
    from kvtier.tiers.faults import FaultyBackend

    st = NvmeStore(nvme_dir, 12, 5000, backend, slots_per_file=5)  # 3 slab files
    items = [(s, pattern(s, 5000), 100 + s, 5000, s, True, 7 + s) for s in (11, 0, 6, 3, 9)]
    assert st.write_many(items).result() == [None] * 5
    for s in (11, 0, 6, 3, 9):
        out = aligned_empty(st.data_stride)
        st.read(s, out).result()
        h = st.read_header(s)
        assert np.array_equal(out[:5000], pattern(s, 5000)) and h is not None and (h.key, h.seq) == (100 + s, 7 + s)
    st.backend = FaultyBackend(backend, fail_writes=2, mode="eio")
    errors = st.write_many([(s, pattern(50 + s, 5000), 200 + s, 5000, 0, True, 20 + s) for s in (1, 2, 4)]).result()
    assert [e is None for e in errors] == [False, False, True]
    h = st.read_header(4)
    assert h is not None and h.key == 204 and st.read_header(1) is None  # slot 1 was never written
    st.close()


def test_bad_arguments(backend, nvme_dir):
    st = NvmeStore(nvme_dir, 2, 4096, backend)
    with pytest.raises(ValueError):
        st.read(2, aligned_empty(4096))
    with pytest.raises(ValueError):
        st.read(0, aligned_empty(8192))
    with pytest.raises(ValueError):
        st.write(0, np.zeros(8192, np.uint8), 1, 8192, 0, True)
    st.close()


def test_bounced_promotion_through_few_buffers(nvme_dir, monkeypatch):
    """The NVMe -> HBM path a GPU without GPUDirect takes (read_bounced), run on CPU:
    7 blocks through 2 reused host buffers, one of them corrupt on disk, land bit
    exact; the corrupt one fails its checksum twice and every buffer comes back."""
    from kvtier.tiers import paths
    from kvtier.tiers.manager import TierManager
    from kvtier.tiers.pools import BounceBuffers
    from kvtier.tiers.types import Tier

    m = TierManager(8192, 8, 0, 8, nvme_dir=nvme_dir, io_backend="posix", io_threads=2)
    try:
        pool = BounceBuffers(2, m.hbm.slot_stride, pin=False)
        landed: list[int] = []

        def land(slot: int, host: np.ndarray) -> None:
            m.hbm.host_slot(slot)[:] = host
            landed.append(slot)

        monkeypatch.setitem(paths.PATHS, (Tier.NVME, Tier.HBM),
                            lambda mv, t, ok, errors: paths.read_bounced(mv, t, ok, errors, pool, land))
        blocks = sealed_blocks(m, 7, 8192, tag0=40, key0=400)
        m.demote(blocks, "hbm", "nvme")
        m.wait()
        bad = int(blocks[4])
        store = m.nvme
        assert store is not None
        handle, off = store.payload_at(int(m.table.slot[2, bad]))
        with open(handle.path, "r+b") as f:
            f.seek(off + 17)
            f.write(b"\xff\x00\xff")
        m.promote(blocks, "hbm")
        m.wait()
        assert set(m.last_errors) == {bad} and "checksum" in m.last_errors[bad]
        assert len(landed) == 6 and sorted(pool.take(5)) == [0, 1]
        for i, b in enumerate(blocks.tolist()):
            if b != bad:
                assert m.table.has_copy(b, 0) and m.read(b) == pattern(40 + i, 8192).tobytes()
        m.check_invariants()
    finally:
        m.close()


@pytest.mark.cuda
@pytest.mark.skipif(not kvikio_status()[0], reason=kvikio_status()[1])
def test_kvikio_device_buffers_round_trip(nvme_dir):
    """GPUDirect: a device slot written and read back device-direct, checked on the device."""
    import torch

    from kvtier.kernels.checksum import block_checksum

    be = select_backend("kvikio", threads=4)
    st = NvmeStore(nvme_dir, 3, 12_000, be)
    try:
        src = torch.from_numpy(np.resize(pattern(8, 12_000), st.data_stride)).cuda()
        want = block_checksum(pattern(8, 12_000))
        assert block_checksum(src, 12_000) == want
        st.write(2, src, key=8, length=12_000, checksum=want, sealed=True).result()
        out = torch.zeros(st.data_stride, dtype=torch.uint8, device="cuda")
        st.read(2, out).result()
        assert torch.equal(out, src) and block_checksum(out, 12_000) == want
        found, _ = st.recover()
        assert [(r.slot, r.header.checksum) for r in found] == [(2, want)]
    finally:
        st.close()
        be.shutdown()


def test_a_read_into_read_only_memory_fails_alone(backend, nvme_dir):
    """One bad buffer among a batch's reads fails that read only; the others land."""
    if backend.name != "posix":
        pytest.skip("kvikio reads device or registered host buffers; this is the posix backend's batch")
    st = NvmeStore(nvme_dir, 3, 4096, backend, slots_per_file=3)
    for s in range(3):
        st.write(s, pattern(s, 4096), key=s + 1, length=4096, checksum=0, sealed=True).result()
    outs = [aligned_empty(st.data_stride) for _ in range(3)]
    outs[1].flags.writeable = False
    handle, _ = st.payload_at(0)
    reads = [(out, st.payload_at(s)[1]) for s, out in enumerate(outs)]
    errors = backend.pread_many(handle, reads).result()
    assert errors[0] is None and errors[2] is None and errors[1] is not None
    assert np.array_equal(outs[0], pattern(0, 4096)) and np.array_equal(outs[2], pattern(2, 4096))
    st.close()


def test_a_read_into_a_non_contiguous_buffer_is_refused_not_lost(backend, nvme_dir):
    """Such a buffer was read into a contiguous copy, and the read (and its checksum, computed
    on the copy) reported done while the caller's buffer stayed as it was."""
    if backend.name != "posix":
        pytest.skip("the posix backend's host buffers")
    st = NvmeStore(nvme_dir, 1, 4096, backend, slots_per_file=1)
    st.write(0, pattern(0, 4096), key=1, length=4096, checksum=0, sealed=True).result()
    handle, offset = st.payload_at(0)
    strided = np.zeros(2 * st.data_stride, np.uint8)[::2]  # every other byte: no view of it is contiguous
    with pytest.raises(ValueError, match="contiguous"):
        backend.pread(handle, [strided], offset)
    f = backend.pread_many(handle, [(strided, offset)])
    assert f.exception(timeout=10) is not None or f.result()[0] is not None
    assert not strided.any()
    st.close()
