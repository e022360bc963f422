"""One conformance suite for every NVMe I/O backend."""

import os

import numpy as np
import pytest

from kvtier.tiers.aligned import aligned_empty
from kvtier.tiers.io_backends import kvikio_status, select_backend
from kvtier.tiers.nvme import HEADER_BYTES, NvmeStore

from ..conftest import pattern


def _backends():
    ok, why = kvikio_status()
    return ["posix", pytest.param("kvikio", marks=pytest.mark.skipif(not ok, reason=why))]


@pytest.fixture(params=_backends())
def backend(request):
    be = select_backend(request.param, threads=4)
    yield be
    be.shutdown()


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
    assert len(os.listdir(nvme_dir)) == 3
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
    handle, _ = st._locate(0)
    bufs = [aligned_empty(4096) for _ in range(5)]
    offsets = [3 * st.slot_bytes + HEADER_BYTES, HEADER_BYTES, 10 * st.slot_bytes,
               2 * st.slot_bytes + HEADER_BYTES, st.slot_bytes + HEADER_BYTES]
    errors = backend.pread_many(handle, list(zip(bufs, offsets))).result()
    assert [e is None for e in errors] == [True, True, False, True, True]
    for buf, slot in zip([bufs[0], bufs[1], bufs[3], bufs[4]], [3, 0, 2, 1]):
        assert np.array_equal(buf, pattern(slot, 4096))
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


def test_recovery_discards_torn_and_open(backend, nvme_dir):
    from kvtier.kernels.checksum import block_checksum

    st = NvmeStore(nvme_dir, 4, 8192, backend, slots_per_file=4)
    for s in range(4):
        data = pattern(s, 8192)
        st.write(s, data, key=50 + s, length=8192, checksum=block_checksum(data), sealed=s != 3).result()
    st.write(2, pattern(2, 8192), key=50, length=8192, checksum=block_checksum(pattern(2, 8192)),
             sealed=True).result()  # newer copy of key 50 (content differs: tests newest-wins)
    st.close()
    path = os.path.join(nvme_dir, "slab-0000.kvt")
    with open(path, "r+b") as f:  # tear slot 1's payload
        f.seek(1 * (HEADER_BYTES + 8192) + HEADER_BYTES + 100)
        f.write(b"\x00\xff\x00")
    st = NvmeStore(nvme_dir, 4, 8192, backend, slots_per_file=4)
    found, discarded = st.recover()
    assert [(r.slot, r.header.key) for r in found] == [(2, 50)]
    assert discarded == 3  # torn slot 1, open slot 3, older copy of key 50 in slot 0
    st.close()


def test_header_only_recovery_never_serves_a_torn_payload(backend, nvme_dir):
    """A fast start reads headers only: a payload torn under a good header is
    recovered, then refused by the checksum of its first read, and quarantined."""
    from kvtier.kernels.checksum import block_checksum
    from kvtier.tiers.manager import TierManager
    from kvtier.tiers.types import CorruptBlockError

    m = TierManager(8192, 2, 2, 4, nvme_dir=nvme_dir, io_backend=backend.name)
    blocks = m.alloc(2)
    for i, b in enumerate(blocks.tolist()):
        m.write(b, pattern(i, 8192))
        m.seal(b, 70 + i)
    m.demote(blocks, "hbm", "nvme")
    m.wait()
    slots = {int(m.table.key[b]): int(m.table.slot[2, b]) for b in blocks.tolist()}
    m.close()
    assert block_checksum(pattern(0, 8192)) != block_checksum(pattern(1, 8192))
    st = NvmeStore(nvme_dir, 4, 8192, backend)
    slot_bytes = st.slot_bytes
    st.close()
    with open(os.path.join(nvme_dir, "slab-0000.kvt"), "r+b") as f:  # tear key 70's payload
        f.seek(slots[70] * slot_bytes + HEADER_BYTES + 100)
        f.write(b"\x00\xff\x00")
    m = TierManager(8192, 2, 2, 4, nvme_dir=nvme_dir, io_backend=backend.name, recover_payloads=False)
    try:
        assert m.recovered == 2 and m.discarded == 0  # both headers are good
        torn, good = m.lookup(70), m.lookup(71)
        assert m.read(good) == pattern(1, 8192).tobytes()
        with pytest.raises(CorruptBlockError):
            m.read(torn)
        m.promote([torn, good], "hbm")
        m.wait()
        assert not m.table.has_copy(torn, 0) and "checksum" in m.last_errors[torn]
        assert m.table.has_copy(good, 0) and m.read(good) == pattern(1, 8192).tobytes()
        m.check_invariants()
    finally:
        m.close()
    m = TierManager(8192, 2, 2, 4, nvme_dir=nvme_dir, io_backend=backend.name)  # the full scan discards it
    try:
        assert m.recovered == 1 and m.discarded == 1 and m.lookup(70) < 0
    finally:
        m.close()
