"""Shared-memory pools reserve their pages when created (real /dev/shm, no mocks)."""

from __future__ import annotations

import errno
import os

import pytest

from kvtier.protocol.shm import attach_shm, create_shm, release_shm, segment_prefix
from kvtier.tiers.pools import DramPool

from ..conftest import SHM, shm_segments_of, shm_total_or_skip


def test_segment_larger_than_dev_shm_fails_at_creation_and_leaves_nothing() -> None:
    too_big = shm_total_or_skip() + (64 << 20)
    before = set(os.listdir(SHM))
    with pytest.raises(OSError) as ei:
        create_shm(too_big)
    assert ei.value.errno == errno.ENOSPC
    assert ei.value.filename and ei.value.filename.startswith(SHM)  # the error names the segment
    assert "free" in str(ei.value)  # ... and says how much /dev/shm had
    assert set(os.listdir(SHM)) - before == set()


def test_dram_pool_larger_than_dev_shm_fails_cleanly() -> None:
    too_big = shm_total_or_skip() + (64 << 20)
    before = shm_segments_of(os.getpid())
    with pytest.raises(OSError) as ei:
        DramPool(too_big // 65536 + 1, 65536)
    assert ei.value.errno == errno.ENOSPC
    assert shm_segments_of(os.getpid()) == before


def test_created_segment_is_named_for_its_creator_and_reserved() -> None:
    shm = create_shm(1 << 20)
    try:
        assert shm.name.startswith(segment_prefix(os.getpid()))
        st = os.stat(os.path.join(SHM, shm.name))
        assert st.st_blocks * 512 >= 1 << 20  # pages reserved, not a sparse file
        other = attach_shm(shm.name)
        other.buf[0] = 7
        assert shm.buf[0] == 7
        release_shm(other, unlink=False)
    finally:
        release_shm(shm, unlink=True)
    assert not os.path.exists(os.path.join(SHM, shm.name))
