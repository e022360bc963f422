"""Building a tier that does not fit: the error names the file, and nothing is left behind.

Real files on tmpfs (/dev/shm): a slab larger than the whole filesystem fails
with ENOSPC before anything is allocated, so no test fills a real disk.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from kvtier.protocol.shm import create_shm, unlink_on_error
from kvtier.tiers import pools
from kvtier.tiers.io_backends import PosixBackend
from kvtier.tiers.nvme import NvmeStore

from ..conftest import shm_segments_of, shm_total_or_skip

BLOCK = 1 << 20








@pytest.fixture
def backend() -> Iterator[PosixBackend]:
    b = PosixBackend(threads=2)
    yield b
    b.shutdown()


def _too_many_slots() -> int:
    return (shm_total_or_skip() + (64 << 20)) // BLOCK  # one slab file larger than the filesystem


def test_new_slab_that_does_not_fit_is_removed_and_named(tmpfs_dir: Path, backend: PosixBackend) -> None:
    with pytest.raises(OSError) as ei:
        NvmeStore(str(tmpfs_dir), _too_many_slots(), BLOCK, backend)
    assert ei.value.errno == errno.ENOSPC
    assert ei.value.filename == str(tmpfs_dir / "slab-0000.kvt")
    assert list(tmpfs_dir.iterdir()) == []


def test_existing_slab_that_cannot_grow_keeps_its_size_and_data(tmpfs_dir: Path, backend: PosixBackend) -> None:
    small = NvmeStore(str(tmpfs_dir), 2, BLOCK, backend)
    payload = np.full(BLOCK, 9, dtype=np.uint8)
    small.write(1, payload, key=5, length=BLOCK, checksum=0, sealed=True).result()
    small.close()
    slab = tmpfs_dir / "slab-0000.kvt"
    size = slab.stat().st_size
    with pytest.raises(OSError) as ei:
        NvmeStore(str(tmpfs_dir), _too_many_slots(), BLOCK, backend)
    assert ei.value.errno == errno.ENOSPC
    assert slab.stat().st_size == size  # the failed growth gave its space back
    again = NvmeStore(str(tmpfs_dir), 2, BLOCK, backend)
    try:
        hdr = again.read_header(1)
        assert hdr is not None and hdr.key == 5
    finally:
        again.close()


def test_dram_pool_whose_numa_binding_fails_unlinks_its_segment(monkeypatch: pytest.MonkeyPatch) -> None:
    shm_total_or_skip()

    def refuse(addr: int, length: int, node: int) -> None:  # the injected fault
        raise OSError(errno.EINVAL, "mbind refused")

    monkeypatch.setattr(pools, "_bind_numa", refuse)
    before = shm_segments_of(os.getpid())
    with pytest.raises(OSError, match="mbind refused"):
        pools.DramPool(4, 4096, numa_node=pools.numa_nodes()[0])
    assert shm_segments_of(os.getpid()) == before


def test_segments_made_in_a_failed_block_are_unlinked() -> None:
    shm_total_or_skip()
    before = shm_segments_of(os.getpid())
    kept = None
    with pytest.raises(RuntimeError):
        with unlink_on_error():
            kept = create_shm(4096)
            create_shm(4096)
            raise RuntimeError("a later build step failed")
    assert kept is not None and shm_segments_of(os.getpid()) == before
    with unlink_on_error():
        kept = create_shm(4096)
    assert kept.name in shm_segments_of(os.getpid())  # success: the caller owns it
    kept.close()
    kept.unlink()
