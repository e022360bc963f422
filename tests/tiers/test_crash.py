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


def test_a_run_that_did_not_recover_outranks_the_old_copies_at_the_next_scan(nvme_dir):
    """``recover=False`` started its write sequence at 0 while the older run's headers still
    validated with higher ones: after it crashed, a scan kept the older run's copy of a key."""
    def crashed(m: TierManager) -> None:  # durable writes, no clean stop's index
        m.nvme.sync()
        m._index_on_close = False
        m.close()

    def put(m: TierManager, key: int, tag: int) -> None:
        b = int(m.alloc(1)[0])
        m.write(b, pattern(tag, BB))
        m.seal(b, key)
        m.free(b)
        m.demote([b], "hbm", "nvme"); m.wait()

    m = TierManager(BB, 4, 0, 64, nvme_dir=nvme_dir, io_backend="posix", io_threads=2)
    for k in range(10):
        put(m, 1000 + k, k)
    put(m, 7, 1)  # seq 11, slot 10
    crashed(m)
    m = TierManager(BB, 4, 0, 64, nvme_dir=nvme_dir, io_backend="posix", io_threads=2, recover=False)
    put(m, 7, 2)  # slot 0
    crashed(m)
    m = TierManager(BB, 4, 0, 64, nvme_dir=nvme_dir, io_backend="posix", io_threads=2)
    try:
        assert m.recovered_from == "scan" and m.read(m.lookup(7)) == pattern(2, BB).tobytes()
    finally:
        m.close()
