"""The compiled share loop of the posix backend (kernels/_blockio.c), on real files."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from kvtier.kernels.checksum import checksum_numpy
from kvtier.tiers.aligned import aligned_empty

bio = pytest.importorskip("kvtier.kernels._blockio")


def test_checksum_is_the_reference_value_at_every_length_and_alignment():
    data = np.random.default_rng(3).integers(0, 256, 4200, dtype=np.uint8)
    for off in range(9):
        for length in [*range(0, 40), 1000, 4095, 4096, 4097, 4200 - off]:
            view = data[off: off + length]
            assert bio.checksum(view, view.size) == checksum_numpy(view), (off, length)
    with pytest.raises(ValueError):
        bio.checksum(data, data.size + 1)


def test_share_of_writes_and_verified_reads_moves_every_byte(tmp_path):
    """Writes of two buffers each (a header page and a payload) land at their offsets;
    reads come back bit-exact, a read whose check does not match says MISMATCH,
    and the jobs around it are unaffected."""
    path = str(tmp_path / "f")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        rng = np.random.default_rng(4)
        heads = [rng.integers(0, 256, 4096, dtype=np.uint8) for _ in range(5)]
        bodies = [rng.integers(0, 256, 8192, dtype=np.uint8) for _ in range(5)]
        offsets = [k * 12288 for k in (3, 0, 4, 1, 2)]
        status = bio.transfer(True, [fd] * 5, offsets, [[memoryview(h), memoryview(b)] for h, b in zip(heads, bodies)],
                              None)
        assert status == [0] * 5
        outs = [np.zeros(8192, np.uint8) for _ in range(5)]
        checks = [(8192, checksum_numpy(b)) for b in bodies]
        checks[2] = (8192, checks[2][1] ^ 1)  # not this block's checksum
        checks[3] = None  # an open block: not verified
        status = bio.transfer(False, [fd] * 5, [o + 4096 for o in offsets], [[memoryview(o)] for o in outs], checks)
        assert status == [0, 0, bio.MISMATCH, 0, 0]
        for out, body in zip(outs, bodies):
            assert np.array_equal(out, body)  # the mismatching read's bytes still landed: the caller refuses them
    finally:
        os.close(fd)


def test_short_file_error_and_bad_arguments(tmp_path):
    """A read past the end resumes across buffers, then says SHORT; a bad descriptor is
    its errno and fails alone; arguments that cannot be used raise before any I/O."""
    path = str(tmp_path / "f")
    with open(path, "wb") as f:
        f.write(bytes(range(256)) * 24)  # 6144 bytes
    fd = os.open(path, os.O_RDWR)
    try:
        a, b, c = np.zeros(4096, np.uint8), np.zeros(4096, np.uint8), np.zeros(200, np.uint8)
        status = bio.transfer(False, [fd, -1, fd], [0, 0, 6000], [[memoryview(a), memoryview(b)], [memoryview(c)],
                                                                  [memoryview(c)]], None)
        assert status == [bio.SHORT, errno.EBADF, bio.SHORT]
        want = np.frombuffer(bytes(range(256)) * 24, np.uint8)
        assert np.array_equal(a, want[:4096]) and np.array_equal(b[:2048], want[4096:]) and not b[2048:].any()
        assert np.array_equal(c[:144], want[6000:]) and not c[144:].any()
        before = os.fstat(fd).st_size
        ro = np.zeros(16, np.uint8)
        ro.flags.writeable = False
        with pytest.raises((BufferError, TypeError, ValueError)):
            bio.transfer(False, [fd], [0], [[ro]], None)  # a read into read-only memory
        with pytest.raises(ValueError):
            bio.transfer(False, [fd], [0], [[memoryview(a)]], [(4097, 0)])  # checked bytes beyond the buffer
        with pytest.raises(ValueError):
            bio.transfer(True, [fd, fd], [0], [[memoryview(a)], [memoryview(a)]], None)  # lengths differ
        with pytest.raises(ValueError):
            bio.transfer(True, [fd], [0], [[memoryview(a)] * (bio.MAX_IOV + 1)], None)
        with pytest.raises(ValueError):
            bio.transfer(True, [fd], [-1], [[memoryview(a)]], None)
        assert os.fstat(fd).st_size == before and np.array_equal(a, want[:4096])
    finally:
        os.close(fd)


def test_o_direct_share_on_aligned_slots(tmp_path):
    """The path the backend takes: O_DIRECT, page-aligned buffers, a share of blocks."""
    path = str(tmp_path / "d")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError as e:
        pytest.skip(f"no O_DIRECT here: {e}")
    try:
        block = 64 << 10
        src = aligned_empty(block * 6)
        src[:] = np.random.default_rng(5).integers(0, 256, src.size, dtype=np.uint8)
        views = [[memoryview(src[i * block:(i + 1) * block])] for i in range(6)]
        assert bio.transfer(True, [fd] * 6, [i * block for i in range(6)], views, None) == [0] * 6
        dst = aligned_empty(block * 6)
        dst[:] = 0
        back = [[memoryview(dst[i * block:(i + 1) * block])] for i in range(6)]
        checks = [(block, checksum_numpy(src[i * block:(i + 1) * block])) for i in range(6)]
        assert bio.transfer(False, [fd] * 6, [i * block for i in range(6)], back, checks) == [0] * 6
        assert np.array_equal(src, dst)
    finally:
        os.close(fd)
