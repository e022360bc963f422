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
