"""The raw O_DIRECT loop that verifies what it reads: it must really check every block,
or the cost it reports for verification is not one."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.bench.baselines import COMPILED_IO, RawODirect
from kvtier.kernels.checksum import block_checksum
from kvtier.tiers.aligned import aligned_empty

pytestmark = pytest.mark.skipif(not COMPILED_IO, reason="the compiled I/O loop was not built")


def test_verified_raw_read_checks_every_block(tmp_path):
    block, n = 64 << 10, 8
    buf = aligned_empty(block * n)
    payload = np.random.default_rng(3).integers(0, 255, block, dtype=np.uint8)
    buf.reshape(n, block)[:] = payload
    raw = RawODirect(str(tmp_path), "v", block, n, buf, threads=4)
    try:
        raw.write_qd_c()
        good = int(block_checksum(payload, block))
        buf[:] = 0
        raw.read_qd_c_verified(good)  # every block holds payload: passes, and the bytes are back
        assert (buf.reshape(n, block) == payload).all()
        with pytest.raises(OSError, match="read failed"):
            raw.read_qd_c_verified(good ^ 1)
        payload[5] ^= 0xFF  # one block on disk differs from the rest: its check fails the read
        buf.reshape(n, block)[6] = payload
        raw.write_qd_c()
        with pytest.raises(OSError, match="read failed"):
            raw.read_qd_c_verified(good)
    finally:
        raw.close()


def test_a_failed_share_is_raised_only_once_every_share_is_done(tmp_path, monkeypatch):
    """A verified read that fails in one share must not return while another share still
    reads into the buffer: the caller rewrites that buffer next (the test above saw a block it
    had just set overwritten by the disk's old bytes)."""
    import threading
    import time

    block, n = 64 << 10, 4
    raw = RawODirect(str(tmp_path), "j", block, n, aligned_empty(block * n), threads=2)
    finished = threading.Event()

    def share(write, lo, hi, sums=None):
        if lo == 0:
            raise OSError("raw O_DIRECT read failed: [5]")
        time.sleep(0.3)
        finished.set()

    monkeypatch.setattr(raw, "_compiled", share)
    try:
        with pytest.raises(OSError, match="read failed"):
            raw.read_qd_c_verified(0)
        assert finished.is_set()
    finally:
        raw.close()
