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
