"""``drop_cached`` (``kvtier clear``) while blocks move or a remote write reads them: every
cached block goes, none comes back after a crash, and a clear that cannot finish in time
changes nothing."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvtier.tiers.faults import FaultyBackend
from kvtier.tiers.io_backends import PosixBackend
from kvtier.tiers.manager import TierManager
from kvtier.tiers.slab_state import KEY_FILE
from kvtier.tiers.types import FREE, OPEN

from ..conftest import pattern

BB = 8192


def _cached_pair(m: TierManager) -> list[int]:
    """Two cached (refcount 0) sealed blocks in HBM, keys 100 and 101."""
    blocks = [int(b) for b in m.alloc(2)]
    for i, b in enumerate(blocks):
        m.write(b, pattern(i, BB))
        m.seal(b, 100 + i)
        m.free(b)
    return blocks


def _crashed(m: TierManager) -> None:
    m.nvme.sync()
    m._index_on_close = False
    m.close()


def test_a_clear_drops_cached_blocks_that_were_moving_and_none_comes_back(nvme_dir):
    """Two cached blocks on their way to a slow disk (the background demotion): the clear
    waits for them, drops both, and after a crash neither key is recovered (the second
    one's header had been packed under the clear's new key and came back)."""
    slow = FaultyBackend(PosixBackend(threads=2), delay_s=0.2)
    m = TierManager(BB, 8, 0, 16, nvme_dir=nvme_dir, io_backend=slow, mover_workers=1)
    a, b = _cached_pair(m)
    m.demote([a], "hbm", "nvme")
    m.demote([b], "hbm", "nvme")  # queued behind the first on the one I/O worker
    assert m.table.busy[a] and m.table.busy[b]
    assert m.drop_cached() == 2
    assert m.lookup(100) < 0 and m.lookup(101) < 0
    assert m.table.state[a] == FREE and m.table.state[b] == FREE
    m.check_invariants()
    _crashed(m)
    m = TierManager(BB, 8, 0, 16, nvme_dir=nvme_dir, io_backend="posix", io_threads=2)
    try:
        assert m.recovered == 0 and m.lookup(100) < 0 and m.lookup(101) < 0
    finally:
        m.close()


def test_a_clear_that_cannot_drain_in_time_changes_nothing(nvme_dir):
    """Transfers still in flight when the drain time runs out: TimeoutError, the header key
    unchanged, every block still served; the next clear, after they land, drops them."""
    slow = FaultyBackend(PosixBackend(threads=2), delay_s=0.5)
    m = TierManager(BB, 8, 0, 16, nvme_dir=nvme_dir, io_backend=slow, mover_workers=1)
    try:
        a, b = _cached_pair(m)
        key = open(os.path.join(nvme_dir, KEY_FILE), "rb").read()
        m.demote([a], "hbm", "nvme")
        with pytest.raises(TimeoutError):
            m.drop_cached(drain_s=0.05)
        assert open(os.path.join(nvme_dir, KEY_FILE), "rb").read() == key
        assert m.lookup(100) == a and m.lookup(101) == b
        assert m.read(b) == pattern(1, BB).tobytes()
        slow.delay_s = 0.0
        assert m.drop_cached() == 2 and m.lookup(100) < 0 and m.lookup(101) < 0
        m.check_invariants()
    finally:
        m.close()


def test_a_cached_block_a_remote_write_reads_loses_its_key_and_goes_at_unhold(nvme_dir):
    """The remote write keeps reading its bytes (the slot stays), but no lookup finds the
    cleared key; its last unhold releases it, and a held block that is referenced stays."""
    m = TierManager(BB, 8, 4, 16, nvme_dir=nvme_dir, io_backend="posix", io_threads=2)
    try:
        held, other = _cached_pair(m)
        live = int(m.alloc(1)[0])
        m.write(live, pattern(9, BB))
        m.seal(live, 102)
        both = np.array([held, live])
        holds = [both, np.array([held])]  # two remote writes read it
        for h in holds:
            m.hold(h)
        account = lambda: (np.concatenate(holds) if holds else np.zeros(0, np.int64),) * 2  # noqa: E731
        m.held_elsewhere.append(account)  # the holder's account, which the invariants check
        placeholder = m.reserve_fetch(1, 0)  # a remote read in flight: not a cached block
        assert m.drop_cached() == 2  # held and other; live is referenced
        assert m.table.state[placeholder[0]] == OPEN and m.table.busy[placeholder[0]] == 1
        m.finish_fetch(placeholder, np.zeros(1, bool), np.array([103], np.uint64), np.zeros(1), np.zeros(1))
        assert m.table.state[placeholder[0]] == FREE
        assert m.lookup(100) < 0 and m.lookup(101) < 0 and m.lookup(102) == live
        assert m.table.state[other] == FREE and m.table.state[held] != FREE
        assert m.read(held) == pattern(0, BB).tobytes()  # the remote write's bytes are intact
        m.check_invariants()
        m.unhold(holds.pop(0))
        assert m.table.state[held] != FREE  # the second write still reads it
        m.check_invariants()
        m.unhold(holds.pop(0))
        assert m.table.state[held] == FREE
        assert m.table.state[live] != FREE and m.lookup(102) == live
        m.check_invariants()
    finally:
        m.close()
