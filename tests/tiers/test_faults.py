import errno
import fcntl
import gc
import logging
import os

import numpy as np
import pytest

from kvtier.tiers import io_backends
from kvtier.tiers.aligned import aligned_empty
from kvtier.tiers.faults import FaultyBackend
from kvtier.tiers.io_backends import PosixBackend
from kvtier.tiers.manager import TierManager
from kvtier.tiers.nvme import NvmeStore
from kvtier.tiers.slot_index import INDEX_FILE
from kvtier.tiers.types import BlockState, Tier

from ..conftest import pattern, sealed_blocks

BB = 9000


def _manager(nvme_dir, **faults) -> tuple[TierManager, FaultyBackend]:
    fb = FaultyBackend(PosixBackend(threads=2), **faults)
    return TierManager(BB, 4, 4, 8, nvme_dir=nvme_dir, io_backend=fb), fb


@pytest.mark.parametrize("mode", ["enospc", "eio", "short"])
def test_failed_write_loses_nothing(nvme_dir, mode):
    m, fb = _manager(nvme_dir, fail_writes=1, mode=mode)
    try:
        blocks = m.alloc(3)
        for i, b in enumerate(blocks.tolist()):
            m.write(b, pattern(i, BB))
        sealed = m.seal(int(blocks[0]), 77)
        m.demote(blocks, "hbm", "dram"); m.wait()
        m.demote(blocks, "dram", "nvme"); m.wait()
        failed = [b for b in blocks.tolist() if not m.table.has_copy(b, Tier.NVME)]
        assert len(failed) == 1 and failed[0] in m.last_errors
        b = failed[0]
        assert m.table.has_copy(b, Tier.DRAM)  # still valid where it was
        for i, x in enumerate(blocks.tolist()):
            assert m.read(x) == pattern(i, BB).tobytes()
        m.check_invariants()
        m.last_errors.clear()
        m.demote([b], "dram", "nvme"); m.wait()  # disk healthy again: retry works
        assert m.table.has_copy(b, Tier.NVME) and not m.last_errors
        assert m.table.state[sealed] == BlockState.SEALED
    finally:
        m.close()


def test_corrupt_read_is_never_served(nvme_dir):
    m, fb = _manager(nvme_dir)
    try:
        b = int(m.alloc(1)[0])
        m.write(b, pattern(1, BB))
        m.seal(b, 1)
        m.demote([b], "hbm", "nvme"); m.wait()
        fb.corrupt_reads = 2  # the read and its one retry: a flip that repeats
        m.promote([b], "hbm"); m.wait()
        assert not m.table.has_copy(b, Tier.HBM)  # bad bytes never became valid
        assert "checksum" in m.last_errors[b]
        m.check_invariants()
        m.promote([b], "hbm"); m.wait()
        assert m.read(b) == pattern(1, BB).tobytes()
    finally:
        m.close()


def test_failed_read_keeps_block(nvme_dir):
    m, fb = _manager(nvme_dir, mode="eio")
    try:
        b = int(m.alloc(1)[0])
        m.write(b, pattern(2, BB))
        m.demote([b], "hbm", "nvme"); m.wait()
        fb.fail_reads = 2  # the read and its one retry
        m.promote([b], "dram"); m.wait()
        assert m.table.copies[b] == 1 << Tier.NVME and b in m.last_errors
        assert m.read(b) == pattern(2, BB).tobytes()
        m.check_invariants()
    finally:
        m.close()


def test_promotion_does_not_wait_behind_a_slow_disk(nvme_dir):
    """Copies and NVMe I/O run in separate lanes: with every disk call stalled
    0.5 s and both I/O workers busy, a DRAM -> HBM promotion still completes (and
    with the right bytes) while the disk transfers are in flight."""
    m, fb = _manager(nvme_dir, delay_s=0.5)
    try:
        blocks = sealed_blocks(m, 4, BB, key0=100)
        m.demote(blocks, "hbm", "dram"); m.wait()
        m.demote(blocks[:2], "dram", "nvme", keep_source=True)  # two stalled disk transfers
        m.demote(blocks[2:3], "dram", "nvme", keep_source=True)
        m.promote(blocks[3:], "hbm")
        done = []
        while not done or done[-1].dst != Tier.HBM:
            done += m.poll(timeout=5.0)
        assert [c.dst for c in done] == [Tier.HBM]  # the copy finished first
        assert m.mover.in_flight == 2
        m.wait()
        assert all(m.table.has_copy(b, Tier.NVME) for b in blocks[:3].tolist())
        for i, b in enumerate(blocks.tolist()):
            assert m.read(b) == pattern(i, BB).tobytes()
        m.check_invariants()
    finally:
        m.close()


def _refuse_direct_io(monkeypatch, at: str) -> "_Refusals":
    """Fault: a filesystem that refuses O_DIRECT, at open or at the first transfer
    (EINVAL either way, as tmpfs on older kernels and some FUSE mounts do)."""
    refused = _Refusals()
    real_open, real_pwritev, real_preadv = os.open, os.pwritev, os.preadv

    def is_direct(fd: int) -> bool:
        return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)

    def fake_open(path, flags, *a, **k):
        if at == "open" and flags & os.O_DIRECT and str(path).endswith(".kvt"):
            refused.append("open")
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a, **k)

    def refusing(real):
        def call(fd, *a):
            if is_direct(fd):
                refused.append("io")
                raise OSError(errno.EINVAL, "Invalid argument")
            return real(fd, *a)
        return call

    monkeypatch.setattr(os, "open", fake_open)
    if at == "io":
        monkeypatch.setattr(os, "pwritev", refusing(real_pwritev))
        monkeypatch.setattr(os, "preadv", refusing(real_preadv))

        def c_refusal(fd: int) -> int:
            if is_direct(fd):
                refused.append("io")
                return errno.EINVAL
            return 0
        refused_in_c = _fail_compiled_io(monkeypatch, c_refusal)
        refused.c = refused_in_c  # type: ignore[attr-defined]
    return refused


class _Refusals(list):
    """Where a fault was injected; ``c``: the compiled loop's share of them."""

    c: list[int] = []


def _fail_compiled_io(monkeypatch, fail) -> list[int]:
    """The same fault for the compiled share loop (kernels/_blockio.c), which calls
    the kernel directly: a job on fd gets status ``fail(fd)`` (an errno) without
    moving a byte where that is not 0; the others move for real. Returns the fds
    it failed, as it fails them."""
    real = io_backends._blockio
    failed: list[int] = []
    if real is None:
        return failed

    class Shim:
        SHORT, MISMATCH, MAX_IOV = real.SHORT, real.MISMATCH, real.MAX_IOV

        @staticmethod
        def transfer(write, fds, offsets, buffers, checks):
            out = []
            for j, fd in enumerate(fds):
                st = fail(fd)
                if st:
                    failed.append(fd)
                out.append(st or real.transfer(write, [fd], [offsets[j]], [buffers[j]],
                                               None if checks is None else [checks[j]])[0])
            return out

    monkeypatch.setattr(io_backends, "_blockio", Shim)
    return failed


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
@pytest.mark.parametrize("at", ["open", "io"])
def test_refused_o_direct_falls_back_to_buffered_io(nvme_dir, monkeypatch, caplog, at, compiled):
    refused = _refuse_direct_io(monkeypatch, at)
    m = TierManager(BB, 8, 8, 8, nvme_dir=nvme_dir, io_backend=PosixBackend(threads=4, compiled=compiled))
    try:
        blocks = sealed_blocks(m, 6, BB, key0=300)
        with caplog.at_level(logging.WARNING, logger="kvtier.io"):
            m.demote(blocks, "hbm", "nvme"); m.wait()
        assert not m.last_errors and refused and set(refused) == {at}
        # the compiled loop met the refusal itself, or (python) never ran
        assert bool(refused.c) == (at == "io" and compiled and io_backends._blockio is not None)
        assert m.nvme is not None and not m.nvme.direct
        warned = [r for r in caplog.records if "O_DIRECT" in r.getMessage()]
        assert len(warned) == len([f for f in os.listdir(nvme_dir) if f.startswith("slab-")])  # once a slab, not a transfer
        m.promote(blocks, "dram"); m.wait()
        assert not m.last_errors
        for i, b in enumerate(blocks.tolist()):
            assert m.table.copies[b] == (1 << Tier.DRAM) | (1 << Tier.NVME)
            assert m.read(b) == pattern(i, BB).tobytes()
        m.check_invariants()
    finally:
        m.close()


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_einval_on_a_buffered_file_is_an_error_not_a_retry(nvme_dir, monkeypatch, compiled):
    """Only O_DIRECT refusals fall back; EINVAL on buffered I/O fails the transfer
    and the block stays where it was. One EINVAL is enough: the write is not tried
    again (on the compiled path the Python call after it would succeed)."""
    if compiled and io_backends._blockio is None:
        pytest.skip("the compiled loop is not built")
    calls = []

    def einval_once(fd, *a):
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwritev(fd, *a)

    real_pwritev = os.pwritev
    _refuse_direct_io(monkeypatch, "open")
    m = TierManager(BB, 4, 4, 4, nvme_dir=nvme_dir, io_backend=PosixBackend(threads=2, compiled=compiled))
    try:
        b = int(m.alloc(1)[0])
        m.write(b, pattern(5, BB))
        m.seal(b, 5)
        if compiled:
            _fail_compiled_io(monkeypatch, lambda fd: 0 if calls.append(fd) or len(calls) > 1 else errno.EINVAL)
        monkeypatch.setattr(os, "pwritev", einval_once)
        m.demote([b], "hbm", "nvme"); m.wait()
        assert len(calls) == 1  # not retried, in C or in Python; and no header for the payload that failed
        assert "Invalid argument" in m.last_errors[b] and m.table.copies[b] == 1 << Tier.HBM
        monkeypatch.undo()
        assert m.read(b) == pattern(5, BB).tobytes()
        m.check_invariants()
    finally:
        m.close()


def test_unreadable_slot_at_restart_is_skipped_and_the_rest_recovered(nvme_dir):
    """A header read that fails during a restart's scan loses that slot only (it is
    never served, and reused); every other sealed block comes back with its bytes.
    Two faults: the read of the whole run of headers fails, so the scan reads each
    header alone, and the first of those fails too."""
    m, _ = _manager(nvme_dir)
    blocks = sealed_blocks(m, 4, BB, key0=400)
    m.demote(blocks, "hbm", "nvme"); m.wait()
    m.close()
    os.unlink(os.path.join(nvme_dir, INDEX_FILE))  # as after a crash: the restart scans
    fb = FaultyBackend(PosixBackend(threads=2), fail_reads=2, mode="eio")
    m = TierManager(BB, 4, 4, 8, nvme_dir=nvme_dir, io_backend=fb, recover_payloads=False)
    try:
        assert m.nvme is not None and m.nvme.unreadable == 1
        back = {int(m.table.key[b]): b for b in range(m.table.max_blocks) if m.table.state[b] == BlockState.SEALED}
        assert len(back) == 3 and set(back) < {400, 401, 402, 403}
        for key, b in back.items():
            assert m.read(b) == pattern(key - 400, BB).tobytes()
        m.check_invariants()
    finally:
        m.close()


@pytest.mark.parametrize("faulty", [False, True])
def test_tier_moves_leave_no_reference_cycles(nvme_dir, faulty):
    """Every object a move creates (futures, their callbacks, completions, failures)
    is freed by reference counting as soon as the move is applied. A reference
    cycle per batch waits for a full collection, which on a daemon holding ~10^6
    objects comes about once a minute: tens of thousands of dead objects pile up
    in between and fragment the I/O threads' malloc arenas (an RSS slope)."""
    fb = FaultyBackend(PosixBackend(threads=2), fail_writes=2, fail_reads=2, corrupt_reads=2, mode="eio")
    m = TierManager(BB, 4, 4, 8, nvme_dir=nvme_dir, io_backend=fb if faulty else PosixBackend(threads=2))
    gc.collect()
    gc.disable()
    try:
        blocks = sealed_blocks(m, 4, BB, key0=200)
        for _ in range(6):  # round trips through every tier; with faults some moves fail
            for src, dst in (("hbm", "dram"), ("dram", "nvme")):
                m.demote([b for b in blocks.tolist() if m.table.has_copy(b, Tier[src.upper()])], src, dst)
                m.wait()
            for b in blocks.tolist():
                if not m.table.has_copy(b, Tier.HBM):
                    m.promote([b], "hbm")
            m.wait()
            m.last_errors.clear()
        for i, b in enumerate(blocks.tolist()):
            assert m.read(b) == pattern(i, BB).tobytes()
        if faulty:
            assert fb.fail_writes == fb.fail_reads == fb.corrupt_reads == 0  # every injected fault fired
        assert gc.collect() == 0  # nothing was left for the cycle collector
    finally:
        gc.enable()
        m.close()


def test_a_buffer_the_backend_cannot_take_fails_its_share_not_the_caller(nvme_dir):
    """Byte views are made on the I/O thread: a buffer the posix backend refuses (not a
    host numpy array) fails the future of the share it is in (the whole share, its good job
    unwritten, as the whole call raised before), and nothing raises to the caller; a later
    share on the same handle is not touched."""
    stride = 8192
    posix = PosixBackend(threads=3)
    st = NvmeStore(nvme_dir, 4, stride, posix)
    try:
        good = aligned_empty(stride)
        good[:] = np.random.default_rng(3).integers(0, 255, stride, dtype=np.uint8)
        h0, off0 = st.payload_at(0)
        h1, off1 = st.payload_at(1)
        bad = posix.pwrite_many([(h0, [good], off0), (h0, [bytearray(stride)], off1)])
        with pytest.raises(TypeError, match="host numpy"):
            bad.result()
        unwritten = aligned_empty(stride)
        assert posix.pread_checked([(h0, [unwritten], off0)], lambda i: None).result() == [None]
        assert not unwritten.any()  # the share failed before any of its writes
        fine = posix.pwrite_many([(h1, [good], off1)])
        assert fine.result() == [None]
        back = aligned_empty(stride)
        assert posix.pread_checked([(h1, [back], off1)], lambda i: None).result() == [None]
        assert np.array_equal(back, good)
    finally:
        st.close()
        posix.shutdown()
