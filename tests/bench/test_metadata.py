"""The metadata walker counts what a running daemon holds: a planted per-block array, once, and no pool bytes."""

from __future__ import annotations

import tempfile

import numpy as np
import pytest

from kvtier.bench import metadata as M


def _service(d: str, blocks: int = 4096):
    svc = M._service(d, blocks, (64, 64, 64))
    M._register(svc, 1)
    return svc


def test_a_planted_per_block_array_is_counted_once():
    with tempfile.TemporaryDirectory() as d:
        svc = _service(d)
        try:
            before = M.walk(svc)
            planted = np.zeros(svc.node.mgr.table.max_blocks, dtype=np.int64)
            svc.node.placement.planted_column = planted  # a new per-block array somebody added
            svc.node.scores.view_of_it = planted[::2]  # a view of it elsewhere: its bytes are not counted twice
            after = M.walk(svc)
            assert after.total - before.total == planted.nbytes
            assert after.arrays == before.arrays + 1
            assert after.by_path[".node.placement.planted_column"] == planted.nbytes
        finally:
            svc.close()


def test_pool_bytes_are_not_metadata():
    with tempfile.TemporaryDirectory() as d:
        svc = _service(d)
        try:
            w = M.walk(svc)
            mgr = svc.node.mgr
            for pool in (mgr.hbm, mgr.dram):  # 64 pages each, seen through numpy and torch: none of it counted
                assert M.walk(pool).total < 64 * pool.slot_stride // 8
            svc.node.placement.pool_view = mgr.dram.host_view_all()  # shared memory seen through numpy
            assert M.walk(svc).total == w.total
        finally:
            svc.close()


def test_report_keys_and_held_blocks_cost_something():
    r = M.report(blocks=20_000)
    for key in ("metadata_bytes_per_block_all", "per_block_arrays_bytes", "per_slot_bytes", "per_held_block_bytes",
                "by_part"):
        assert key in r
    assert set(r["per_slot_bytes"]) == {"hbm", "dram", "nvme"}
    assert r["metadata_bytes_per_block_all"] > r["per_block_arrays_bytes"] > 0
    assert r["per_held_block_bytes"] > 0 and ".node.mgr.table" in r["by_part"]


@pytest.mark.parametrize("engines", [1, 16])
def test_a_daemon_at_a_million_blocks_keeps_all_its_metadata_within_the_budget(engines):
    """Issue #15's budget, 256 B a block at 10^6 blocks, for every per-block array and slot
    (constant-size tables spread over the blocks) and the state of the blocks engines hold
    (HBM's 25%), with one engine and with the 16 `bench scale` attaches (each engine's
    references and pins share one byte a block): a new column, a table grown past it or a
    Python object per held block fails here."""
    r = M.report(blocks=1_000_000, engines=engines)
    assert r["engines"] == engines
    assert r["metadata_bytes_per_block_all"] <= 256.0, r["by_part"]
    assert 0 < r["per_held_block_bytes"] <= 16.0  # a sequence's int32 entry, not a dict entry and an int
