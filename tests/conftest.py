"""Shared fixtures: real temp directories, real shared memory, real files."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from kvtier.tiers.manager import TierManager

SHARED = pathlib.Path(__file__).resolve().parents[1].parent / "shared"
TRACES = SHARED / "traces"


def pattern(tag: int, nbytes: int) -> np.ndarray:
    """Deterministic bytes for ``tag``: a mismatch after any move is caught."""
    return np.random.default_rng(tag & 0xFFFFFFFF).integers(0, 256, nbytes, dtype=np.uint8)


def snapshot(m: TierManager) -> dict[str, np.ndarray]:
    t = m.table
    cols = {
        name: getattr(t, name).copy()
        for name in ("key", "state", "refcount", "pins", "busy", "copies", "slot", "nbytes", "checksum")
    }
    for i, lst in enumerate(t.evictable):
        cols[f"evict{i}"] = lst.to_array()
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


