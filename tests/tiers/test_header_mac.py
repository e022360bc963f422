"""Slot headers are MACs bound to their place: a restart under another layout adopts no old
header, and bytes a tenant planted in its own K/V never decode as a header (before slot
version 6, a tenant whose payload came to lie where the new layout reads headers could name
another tenant's key and have its bytes served under it)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvtier.kernels.checksum import block_checksum
from kvtier.tiers.manager import TierManager
from kvtier.tiers.slab_layout import HEADER_BYTES, SlabLayout
from kvtier.tiers.slab_state import KEY_FILE
from kvtier.tiers.slot_header import FLAG_SEALED, header_place, pack_header

B1, B2, N = 8192, 12288, 1024  # run 1's block size, run 2's (another model registered first)
TARGET = 600  # a slot of run 2's second group, whose header lies inside run 1's payloads
K = 0xDEADBEEF  # a key nobody sealed
EVIL = np.frombuffer(b"attacker bytes served under key K! " * 240, dtype=np.uint8)[:B1].copy()


def _run1(d: str, content: dict[int, np.ndarray]) -> None:
    """A tenant's sealed blocks, slot s holding ``content[s]`` (key s + 1), then a crash."""
    m = TierManager(B1, 64, 0, N, nvme_dir=d, io_backend="posix", io_threads=2)
    for lo in range(0, N, 64):
        blocks = m.alloc(64)
        for i, b in enumerate(blocks.tolist()):
            m.write(b, content[lo + i])
            m.seal(b, 1 + lo + i)
        m.demote(blocks, "hbm", "nvme"); m.wait()
        for b in blocks.tolist():
            m.free(b)
    assert int(m.table.slot[2, m.lookup(1)]) == 0 and int(m.table.slot[2, m.lookup(N)]) == N - 1
    m.nvme.sync()
    m._index_on_close = False  # no clean stop: the next start scans
    m.close()


def _run2(d: str) -> TierManager:
    return TierManager(B2, 4, 0, N, nvme_dir=d, io_backend="posix", io_threads=2)


def test_a_restart_under_another_block_size_adopts_no_old_header(nvme_dir):
    """Group 0's headers lie at the same offsets in both layouts, but each describes a payload
    at another offset now: none is adopted (before: 512 were, each failing at its read)."""
    _run1(nvme_dir, {s: np.full(B1, s % 251, dtype=np.uint8) for s in range(N)})
    m = _run2(nvme_dir)
    try:
        assert m.recovered == 0 and all(m.lookup(k) < 0 for k in range(1, N + 1))
    finally:
        m.close()


def _plant(mac_key: bytes) -> dict[int, np.ndarray]:
    """Run 1's payloads with a header for key K, made with ``mac_key``, where run 2 reads slot
    TARGET's header, and the attacker's bytes where run 2 reads its payload."""
    old, new = SlabLayout(N, B1, 65536), SlabLayout(N, B2, 65536)

    def old_slot_at(off: int) -> tuple[int, int]:
        s = next(s for s in range(N) if 0 <= off - old.payload_offset(s)[1] < B1)
        return s, off - old.payload_offset(s)[1]

    (hs, hpos), (ps, ppos) = old_slot_at(new.header_offset(TARGET)[1]), old_slot_at(new.payload_offset(TARGET)[1])
    assert hs != ps and hpos + 64 <= B1 and ppos == 0
    page = np.zeros(HEADER_BYTES, dtype=np.uint8)
    pack_header(memoryview(page), K, B1, block_checksum(EVIL, B1), 1 << 62, FLAG_SEALED, 0,
                mac_key, header_place(TARGET, B2, 65536))
    content = {s: np.zeros(B1, dtype=np.uint8) for s in range(N)}
    content[hs][hpos: hpos + 64] = page[:64]
    content[ps][:] = EVIL
    return content


@pytest.mark.parametrize("knows_the_key", [False, True], ids=["forged", "control"])
def test_a_header_planted_in_a_tenant_s_payload_is_not_adopted(nvme_dir, knows_the_key):
    """The tenant knows the layout and the header format, not the directory's secret: its
    header fails the MAC. The control, made with the secret itself, is adopted: the planted
    bytes do lie where run 2 reads that header."""
    secret = os.urandom(16)
    if knows_the_key:
        with open(os.path.join(nvme_dir, KEY_FILE), "wb") as f:  # the store will read this one
            f.write(secret)
    _run1(nvme_dir, _plant(secret))
    m = _run2(nvme_dir)
    try:
        b = m.lookup(K)
        if knows_the_key:
            assert b >= 0 and m.read(b) == EVIL.tobytes()
        else:
            assert b < 0 and m.recovered == 0
    finally:
        m.close()
