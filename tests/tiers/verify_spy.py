"""Where NVMe reads are verified: the thread of every block checksum a read is checked by."""

from __future__ import annotations

import threading

import pytest

import kvtier.tiers.nvme as nvme
import kvtier.tiers.nvme_batch as nvme_batch
from kvtier.kernels.checksum import block_checksum
from kvtier.tiers import io_backends


class Verifications(list):
    """Thread names of every verification; ``in_c``: how many the compiled loop did."""

    in_c = 0


def spy_verifications(monkeypatch: pytest.MonkeyPatch) -> Verifications:
    """Record the thread name of every verification of a read: the store's Python
    check (``nvme.block_checksum``) and, where the posix backend's compiled share loop
    runs, each job it verified in C (status 0 with a check). A job the loop did not
    verify (a mismatch, an error, end of file) is counted by the Python check that
    then runs, once."""
    where = Verifications()

    def python_check(buf, length=None):
        where.append(threading.current_thread().name)
        return block_checksum(buf, length)

    monkeypatch.setattr(nvme, "block_checksum", python_check)  # reads of any buffer
    monkeypatch.setattr(nvme_batch, "block_checksum", python_check)  # reads into a pool's rows
    real = io_backends._blockio
    if real is not None:

        class CompiledSpy:
            SHORT, MISMATCH, MAX_IOV = real.SHORT, real.MISMATCH, real.MAX_IOV

            @staticmethod
            def transfer(write, fds, offsets, buffers, checks):
                out = real.transfer(write, fds, offsets, buffers, checks)
                verified = [threading.current_thread().name for c, st in zip(checks or [], out)
                            if c is not None and st == 0]
                where.extend(verified)
                where.in_c += len(verified)
                return out

        monkeypatch.setattr(io_backends, "_blockio", CompiledSpy)
    return where
