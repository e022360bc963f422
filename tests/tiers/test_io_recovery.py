"""Conformance of NVMe recovery for every I/O backend: what a restart finds on the slabs."""

import os

import numpy as np
import pytest

from kvtier.tiers.nvme import NvmeStore

from ..conftest import pattern, sealed_blocks


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
        f.seek(st.layout.payload_offset(1)[1] + 100)
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
    blocks = sealed_blocks(m, 2, 8192, key0=70)
    m.demote(blocks, "hbm", "nvme")
    m.wait()
    slots = {int(m.table.key[b]): int(m.table.slot[2, b]) for b in blocks.tolist()}
    m.close()
    assert block_checksum(pattern(0, 8192)) != block_checksum(pattern(1, 8192))
    st = NvmeStore(nvme_dir, 4, 8192, backend)
    st.close()
    with open(os.path.join(nvme_dir, "slab-0000.kvt"), "r+b") as f:  # tear key 70's payload
        f.seek(st.layout.payload_offset(slots[70])[1] + 100)
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


def _xxh3_checksum(buf, length=None) -> int:
    """The payload checksum of header version 1 (xxh3-64), to write old-format slabs."""
    import xxhash

    mv = np.asarray(buf).reshape(-1).view(np.uint8).data
    return xxhash.xxh3_64_intdigest(mv if length is None else mv[:length])


def test_recovery_discards_slots_of_an_older_version(backend, nvme_dir, monkeypatch):
    """Version-1 slots (xxh3 payload checksums) are discarded at recovery, cleanly:
    nothing recovered, nothing raised, the slots are written and found again, and a
    discarded header is zeroed, so the next start does not count it again."""
    import kvtier.tiers.slot_header as slot_header

    monkeypatch.setattr(slot_header, "VERSION", 1)
    st = NvmeStore(nvme_dir, 4, 8192, backend, slots_per_file=4)
    for s in range(4):
        st.write(s, pattern(s, 8192), key=60 + s, length=8192, checksum=_xxh3_checksum(pattern(s, 8192)),
                 sealed=True).result()
    st.close()
    monkeypatch.undo()
    assert slot_header.VERSION >= 2
    st = NvmeStore(nvme_dir, 4, 8192, backend, slots_per_file=4)
    try:
        for verify, expect in ((True, 4), (False, 0)):
            found, discarded = st.recover(verify_payload=verify)
            assert found == [] and discarded == expect and st.unreadable == 0
        st.write(1, pattern(7, 8192), key=99, length=8192, checksum=0, sealed=True).result()
        found, discarded = st.recover(verify_payload=False)
        assert [(r.slot, r.header.key) for r in found] == [(1, 99)] and discarded == 0
    finally:
        st.close()


@pytest.mark.parametrize("recover_payloads", [True, False])
def test_manager_starts_empty_over_old_format_slabs(backend, nvme_dir, monkeypatch, recover_payloads):
    """A tier left by the xxh3 version (slots and the clean stop's index) comes up
    empty and usable: the old index fails its checksum, the scan discards the slots."""
    import kvtier.tiers.manager as manager_mod
    import kvtier.tiers.nvme as nvme
    import kvtier.tiers.nvme_recovery as nvme_recovery
    import kvtier.tiers.paths as paths
    import kvtier.tiers.slot_header as slot_header
    import kvtier.tiers.slot_index as slot_index
    from kvtier.tiers.manager import TierManager

    for mod in (manager_mod, paths, slot_index, nvme, nvme_recovery):
        monkeypatch.setattr(mod, "block_checksum", _xxh3_checksum)
    monkeypatch.setattr(slot_header, "VERSION", 1)
    m = TierManager(8192, 4, 0, 4, nvme_dir=nvme_dir, io_backend=backend.name)
    blocks = sealed_blocks(m, 3, 8192, tag0=20, key0=80)
    m.demote(blocks, "hbm", "nvme")
    m.wait()
    assert not m.last_errors
    m.close()  # clean stop: writes the slot index
    monkeypatch.undo()
    m = TierManager(8192, 4, 0, 4, nvme_dir=nvme_dir, io_backend=backend.name, recover_payloads=recover_payloads)
    try:
        assert m.recovered == 0 and m.discarded == 3 and m.lookup(80) < 0
        b = int(m.alloc(1)[0])
        m.write(b, pattern(5, 8192))
        key = m.seal(b, 90)
        m.demote([key], "hbm", "nvme")
        m.wait()
        m.promote([key], "hbm")
        m.wait()
        assert not m.last_errors and m.read(key) == pattern(5, 8192).tobytes()
        m.check_invariants()
    finally:
        m.close()
