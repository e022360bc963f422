import os
import pathlib
import signal
import subprocess
import sys

import pytest

from kvtier.tiers.manager import TierManager
from kvtier.tiers.types import CorruptBlockError, Tier

from ..conftest import pattern
from .crash_writer import BB

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("payloads", [True, False], ids=["full-scan", "headers-only"])
def test_kill_mid_write_then_recover(nvme_dir, payloads):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "tests.tiers.crash_writer", nvme_dir],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    done = []
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            done.append(int(line))
            if len(done) >= 200:
                break
    finally:
        proc.send_signal(signal.SIGKILL)  # mid-stream: writes are in flight
        proc.wait(10)
    assert len(done) >= 200
    m = TierManager(BB, 8, 0, 4000, nvme_dir=nvme_dir, io_backend="posix", recover_payloads=payloads)
    try:
        m.check_invariants()
        assert m.recovered >= len(done)
        for key in done:  # every acknowledged write survived
            b = m.lookup(key)
            assert b >= 0 and m.table.has_copy(b, Tier.NVME)
        for b in range(m.table.max_blocks):  # and nothing recovered is wrong
            if m.table.has_copy(b, Tier.NVME):
                try:
                    assert m.read(b) == pattern(int(m.table.key[b]), BB).tobytes()
                except CorruptBlockError:  # headers-only: a payload torn by the kill, refused on read
                    assert not payloads and int(m.table.key[b]) not in done
        assert m.table.refcount[m.lookup(done[0])] == 0  # recovered as cached
    finally:
        m.close()


def _crashed(m: TierManager) -> None:
    """Durable writes, no clean stop's index: the next start scans."""
    m.nvme.sync()
    m._index_on_close = False
    m.close()


def _put(m: TierManager, key: int, tag: int) -> None:
    b = int(m.alloc(1)[0])
    m.write(b, pattern(tag, BB))
    m.seal(b, key)
    m.free(b)
    m.demote([b], "hbm", "nvme"); m.wait()


def test_a_run_that_did_not_recover_outranks_the_old_copies_at_the_next_scan(nvme_dir):
    """``recover=False`` started its write sequence at 0 while the older run's headers still
    validated with higher ones: after it crashed, a scan kept the older run's copy of a key."""
    m = TierManager(BB, 4, 0, 64, nvme_dir=nvme_dir, io_backend="posix", io_threads=2)
    for k in range(10):
        _put(m, 1000 + k, k)
    _put(m, 7, 1)  # seq 11, slot 10
    _crashed(m)
    m = TierManager(BB, 4, 0, 64, nvme_dir=nvme_dir, io_backend="posix", io_threads=2, recover=False)
    _put(m, 7, 2)  # slot 0
    _crashed(m)
    m = TierManager(BB, 4, 0, 64, nvme_dir=nvme_dir, io_backend="posix", io_threads=2)
    try:
        assert m.recovered_from == "scan" and m.read(m.lookup(7)) == pattern(2, BB).tobytes()
    finally:
        m.close()


@pytest.mark.parametrize("clock", ["steady", "set back an hour"])
def test_a_tier_that_shrank_and_grew_back_serves_the_newest_copy(nvme_dir, monkeypatch, clock):
    """A smaller tier does not scan the slots beyond it, whose headers may carry higher write
    sequences than any it saw: its writes must still outrank them when the tier grows back,
    also when the clock was set back meanwhile (the floor the last run left holds)."""
    import kvtier.tiers.slab_state as slab_state

    m = TierManager(BB, 4, 0, 64, nvme_dir=nvme_dir, io_backend="posix", io_threads=2)
    for k in range(20):
        _put(m, 1000 + k, k)  # slots 0..19
    _put(m, 7, 1)  # slot 20: beyond the smaller tier
    _crashed(m)
    if clock != "steady":
        now = slab_state.time.time_ns
        monkeypatch.setattr(slab_state.time, "time_ns", lambda: now() - 3600 * 10**9)
    m = TierManager(BB, 4, 0, 16, nvme_dir=nvme_dir, io_backend="posix", io_threads=2)
    assert m.lookup(7) < 0
    m.drop(m.lookup(1003))  # room for the new copy
    _put(m, 7, 2)
    _crashed(m)
    m = TierManager(BB, 4, 0, 64, nvme_dir=nvme_dir, io_backend="posix", io_threads=2)
    try:
        assert m.recovered_from == "scan" and m.read(m.lookup(7)) == pattern(2, BB).tobytes()
    finally:
        m.close()



@pytest.mark.parametrize("stop", ["crash", "clean stop, payload scan", "clean stop, index"])
def test_cleared_blocks_do_not_come_back_after_a_restart(nvme_dir, stop):
    """``kvtier clear`` voids every header on disk: no copy of a cleared key comes back at a
    later scan, not even an older one in a slot freed before the clear (key 7's first copy).
    A block written after the clear does; one kept through it (referenced) comes back only
    through a clean stop's index, which lists it (a scan no longer finds its header)."""
    m = TierManager(BB, 8, 0, 64, nvme_dir=nvme_dir, io_backend="posix", io_threads=2)
    _put(m, 7, 1)
    m.drop(m.lookup(7))  # its slot is free, its header still on disk
    _put(m, 7, 2)
    kept = int(m.alloc(1)[0])
    m.write(kept, pattern(3, BB))
    m.seal(kept, 100)
    m.demote([kept], "hbm", "nvme"); m.wait()
    assert m.drop_cached() == 1 and m.lookup(7) < 0 and m.lookup(100) == kept
    _put(m, 200, 4)
    if stop == "crash":
        _crashed(m)
    else:
        m.close()
    m = TierManager(BB, 8, 0, 64, nvme_dir=nvme_dir, io_backend="posix", io_threads=2,
                    recover_payloads=stop == "clean stop, payload scan")
    try:
        assert m.lookup(7) < 0
        assert m.read(m.lookup(200)) == pattern(4, BB).tobytes()
        if stop == "clean stop, index":
            assert m.recovered_from == "index" and m.read(m.lookup(100)) == pattern(3, BB).tobytes()
        else:
            assert m.recovered_from == "scan" and m.recovered == 1 and m.lookup(100) < 0
    finally:
        m.close()


def test_a_clear_whose_new_header_key_cannot_be_written_drops_nothing(nvme_dir, monkeypatch):
    """The key is replaced by a rename: a disk that refuses it leaves the old key, no temporary
    file, and every block where it was (still served)."""
    import kvtier.tiers.slab_state as slab_state

    m = TierManager(BB, 8, 0, 64, nvme_dir=nvme_dir, io_backend="posix", io_threads=2)
    try:
        for i in range(3):
            _put(m, 100 + i, i)
        key = open(os.path.join(nvme_dir, slab_state.KEY_FILE), "rb").read()

        def refused(src, dst):
            raise OSError(5, "Input/output error")
        monkeypatch.setattr(slab_state.os, "replace", refused)
        with pytest.raises(OSError) as ei:
            m.drop_cached()
        monkeypatch.undo()
        assert ei.value.errno == 5 and ei.value.filename == os.path.join(nvme_dir, slab_state.KEY_FILE)
        assert sorted(os.listdir(nvme_dir)) == ["header.key", "seq.floor", "slab-0000.kvt"]
        assert open(os.path.join(nvme_dir, slab_state.KEY_FILE), "rb").read() == key
        assert m.read(m.lookup(101)) == pattern(1, BB).tobytes()
    finally:
        m.close()
