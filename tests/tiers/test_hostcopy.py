"""Chunked host copies: every byte lands where asked, whatever thread copies it."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvtier.tiers import hostcopy
from kvtier.tiers.hostcopy import HostCopier, chunks

from ..conftest import pattern


def test_chunks_split_large_runs_and_group_small_ones():
    """A chunk closes once it holds ``chunk_bytes``: 3 MiB rows go two to a chunk,
    1 MiB runs four to a chunk, and the last chunk takes what is left, in order."""
    big_src, big_dst = np.ones((10, 3 << 20), np.uint8), np.zeros((10, 3 << 20), np.uint8)
    small = [(np.zeros((1, 1 << 20), np.uint8), np.ones((1, 1 << 20), np.uint8)) for _ in range(6)]
    parts = chunks([(big_dst, big_src), *small], chunk_bytes=4 << 20)
    assert [[d.shape[0] for d, _ in part] for part in parts] == [[1, 1]] * 5 + [[1, 1, 1, 1], [1, 1]]
    assert [d.ctypes.data for part in parts for d, _ in part] == (
        [big_dst[i:].ctypes.data for i in range(10)] + [d.ctypes.data for d, _ in small])


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_copy_moves_every_byte_of_scattered_runs(threads, monkeypatch):
    monkeypatch.setattr(hostcopy, "CHUNK_BYTES", 64 << 10)  # many chunks from small arrays
    src = pattern(threads, 64 * 20_000).reshape(64, 20_000)
    dst = np.zeros_like(src)
    runs = [(0, 5, 7), (10, 40, 20), (33, 0, 1), (40, 20, 19)]  # (dst start, src start, rows)
    who: set[str] = set()
    real = np.copyto

    def spy(d, s):
        who.add(threading.current_thread().name)
        real(d, s)

    monkeypatch.setattr(hostcopy.np, "copyto", spy)
    c = HostCopier(threads)
    try:
        c.copy([(dst[di: di + k], src[si: si + k]) for di, si, k in runs])
    finally:
        c.close()
    want = np.zeros_like(src)
    for di, si, k in runs:
        want[di: di + k] = src[si: si + k]
    assert np.array_equal(dst, want)
    assert threading.current_thread().name in who  # the caller always copies
    assert all(n == threading.current_thread().name or n.startswith("kvtier-copy") for n in who)


def test_a_failed_chunk_raises_on_the_caller():
    c = HostCopier(2)
    try:
        with pytest.raises(ValueError):
            c.copy([(np.zeros((8, 1 << 20), np.uint8), np.zeros((8, 1 << 19), np.uint8))])  # shapes differ
    finally:
        c.close()
