"""Chunked host copies: every byte lands where asked, whatever thread copies it."""

from __future__ import annotations

import threading
import time

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


COMPILED = [False, pytest.param(True, marks=pytest.mark.skipif(
    hostcopy._c_copy_pairs is None, reason="the compiled copy (kernels/_copy.c) was not built"))]


@pytest.mark.parametrize("compiled", COMPILED)
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_copy_moves_every_byte_of_scattered_runs(threads, compiled, monkeypatch):
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
    c = HostCopier(threads, compiled=compiled)
    pairs = [(dst[di: di + k], src[si: si + k]) for di, si, k in runs]
    assert len(hostcopy.chunks(pairs)) > threads  # several parts: helpers share the job
    try:
        c.copy(pairs)
    finally:
        c.close()
    want = np.zeros_like(src)
    for di, si, k in runs:
        want[di: di + k] = src[si: si + k]
    assert np.array_equal(dst, want)
    if compiled:  # the C loop never calls numpy
        assert not who
        return
    me = threading.current_thread().name
    if threads == 1:  # no helpers: the caller copies everything
        assert who == {me}
    assert all(n == me or n.startswith("kvtier-copy") for n in who)  # helpers may take every part first


@pytest.mark.parametrize("compiled", COMPILED)
def test_a_failed_chunk_raises_on_the_caller(compiled):
    c = HostCopier(2, compiled=compiled)
    try:
        with pytest.raises(ValueError):
            c.copy([(np.zeros((8, 1 << 20), np.uint8), np.zeros((8, 1 << 19), np.uint8))])  # shapes differ
    finally:
        c.close()


def _stream_kinds() -> list[str]:
    """Every streaming loop this CPU runs (``none``: memmove only)."""
    if hostcopy._c_copy_pairs is None:
        return []
    from kvtier.kernels import _copy
    return list(_copy.streaming_kinds())


@pytest.mark.skipif(hostcopy._c_copy_pairs is None, reason="the compiled copy (kernels/_copy.c) was not built")
@pytest.mark.parametrize("kind", _stream_kinds())
@pytest.mark.parametrize("threads", [1, 2])
def test_compiled_streaming_copy_is_exact_at_any_alignment(threads, kind):
    """Pairs past the streaming threshold (64 KiB), at destination offsets that are
    not cache-line or page aligned and lengths that are not a multiple of the store
    width, of the linear loops' 4-vector step or of the four-page loops' span: every byte
    lands, and nothing beside the destination range is written, with each loop the CPU runs."""
    from kvtier.kernels import _copy
    src = pattern(5, 3 << 20)
    c = HostCopier(threads)
    before = _copy.use_streaming(kind)
    try:
        for off, n in [(0, 1 << 20), (3, (1 << 20) + 77), (61, 600_001), (64, 2 << 20), (4095, 64 << 10),
                       (4096, (16 << 10) * 5 - 1), (1, (16 << 10) + 4095), (2048, (2 << 20) + 16385)]:
            dst = np.zeros((3 << 20) + 8192, dtype=np.uint8)
            c.copy([(dst[off: off + n], src[7: 7 + n])])
            assert np.array_equal(dst[off: off + n], src[7: 7 + n]), (off, n)
            assert not dst[:off].any() and not dst[off + n:].any(), (off, n)
    finally:
        _copy.use_streaming(before)
        c.close()


@pytest.mark.skipif(hostcopy._c_copy_pairs is None, reason="the compiled copy (kernels/_copy.c) was not built")
def test_streaming_refuses_a_loop_the_cpu_lacks():
    from kvtier.kernels import _copy
    kinds, now = _stream_kinds(), _copy.streaming()
    assert kinds[0] == "none" and now in kinds
    with pytest.raises(ValueError):
        _copy.use_streaming("sse9")
    for lacking in {"avx2", "avx512", "avx2_linear", "avx512_linear"} - set(kinds):
        with pytest.raises(ValueError, match="not a loop this CPU runs"):
            _copy.use_streaming(lacking)
    assert _copy.streaming() == now  # a refused loop changes nothing


@pytest.mark.parametrize("compiled", COMPILED)
def test_strided_pairs_copy_exactly(compiled):
    """A layer-wise promotion copies one column range of every slot: pairs that are
    not contiguous take numpy's copy, and land exactly."""
    src = pattern(9, 8 * 4096).reshape(8, 4096)
    dst = np.zeros_like(src)
    c = HostCopier(2, compiled=compiled)
    try:
        c.copy([(dst[1:5, 1024:2048], src[3:7, 1024:2048]), (dst[6:8], src[0:2])])
    finally:
        c.close()
    want = np.zeros_like(src)
    want[1:5, 1024:2048] = src[3:7, 1024:2048]
    want[6:8] = src[0:2]
    assert np.array_equal(dst, want)


@pytest.mark.skipif(hostcopy._c_copy_pairs is None, reason="the compiled copy (kernels/_copy.c) was not built")
def test_compiled_copy_checks_every_pair_before_moving_a_byte():
    """A bad pair anywhere in the job (lengths differ; a read-only destination) is
    refused before any pair is copied: the destinations are unchanged."""
    good_dst, good_src = np.zeros(1 << 20, np.uint8), np.ones(1 << 20, np.uint8)
    ro = np.zeros(1 << 10, np.uint8)
    ro.flags.writeable = False
    for bad in [(np.zeros(10, np.uint8), np.ones(11, np.uint8)), (ro, np.ones(1 << 10, np.uint8))]:
        c = HostCopier(2)
        try:
            with pytest.raises((ValueError, BufferError)):
                c.copy([(good_dst, good_src), bad])
        finally:
            c.close()
        assert not good_dst.any()
    with pytest.raises(ValueError, match="one length"):
        hostcopy._c_copy_pairs([good_dst], [])


@pytest.mark.skipif(hostcopy._c_start_rows is None, reason="the compiled copy (kernels/_copy.c) was not built")
def test_a_started_copy_lands_before_its_join_and_join_releases_it():
    """``start_rows`` copies on the kernel's threads with no Python thread pulling: the copy is
    done before anyone joins; ``join`` returns its bytes once; a dropped job is waited for."""
    rows = 64
    src = pattern(9, rows * 8192).reshape(rows, 8192)
    dst = np.zeros_like(src)
    c = HostCopier(2)
    try:
        order = np.random.default_rng(0).permutation(rows)
        job = c.start_rows(dst, order, src, np.arange(rows))
        assert job is not None
        deadline = time.monotonic() + 10
        while not job.done() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert job.done() and np.array_equal(dst[order], src)
        assert job.join() == src.nbytes
        with pytest.raises(RuntimeError, match="joined already"):
            job.join()
        dst[:] = 0
        job = c.start_rows(dst, np.arange(rows), src, np.arange(rows))
        del job  # waits for the copy: its buffers outlive no helper
        assert np.array_equal(dst, src)
        assert c.start_rows(dst[:, ::2], np.arange(rows), src[:, ::2], np.arange(rows)) is None  # strided: numpy's
        with pytest.raises(IndexError):
            c.start_rows(dst, np.array([rows]), src, np.array([0]))
    finally:
        c.close()


@pytest.mark.skipif(hostcopy._c_copy_rows is None, reason="the compiled copy (kernels/_copy.c) was not built")
@pytest.mark.parametrize("seed", range(6))
def test_rows_copied_by_the_kernel_match_numpy_for_any_layout(seed):
    """The kernel finds the runs in the row numbers itself: scattered rows, runs on one side
    only, runs on both, repeats of a source row, and a destination run that breaks where the
    source one goes on, all land as numpy's fancy-index copy leaves them, synchronously and
    started; nothing outside the named rows is written."""
    rng = np.random.default_rng(seed)
    rows, width = 96, int(rng.choice([64, 4096, 70_000]))
    src = rng.integers(0, 255, (rows, width), dtype=np.uint8)
    k = int(rng.integers(1, rows))
    layouts = [rng.permutation(rows)[:k], np.arange(k), np.sort(rng.permutation(rows)[:k])]
    dst_idx = layouts[seed % 3]
    src_idx = [np.arange(k) + int(rng.integers(0, rows - k + 1)), rng.integers(0, rows, k),
               np.where(np.arange(k) % 5 == 4, rng.integers(0, rows, k), np.arange(k))][seed // 2 % 3]
    c = HostCopier(2)
    try:
        for how in ("copy", "start"):
            dst = np.zeros((rows, width), np.uint8)
            want = dst.copy()
            want[dst_idx] = src[src_idx]
            if how == "copy":
                c.copy_rows(dst, dst_idx, src, src_idx)
            else:
                job = c.start_rows(dst, dst_idx, src, src_idx)
                assert job is not None and job.join() == k * width
            assert np.array_equal(dst, want), how
    finally:
        c.close()


def test_rows_of_one_array_copy_in_order_and_rows_outside_are_refused_on_every_path():
    """Rows moved within one array (overlapping runs) land as one-by-one row copies in order
    would leave them, and are never started on the kernel's threads; rows outside either
    array are refused before a byte moves, strided views too."""
    rng = np.random.default_rng(5)
    c = HostCopier(2)
    try:
        for shift in (1, 3, -2):
            a = rng.integers(0, 255, (64, 16 << 10), dtype=np.uint8)
            want = a.copy()
            src = np.arange(10, 50)
            for s_, d_ in zip(src.tolist(), (src + shift).tolist()):
                if shift < 0:
                    want[d_] = want[s_]
            if shift > 0:
                want[src + shift] = a[src]
            c.copy_rows(a, src + shift, a, src)
            assert np.array_equal(a, want), shift
            assert c.start_rows(a, src + shift, a, src) is None
        a, b = np.zeros((8, 64), np.uint8), np.ones((8, 64), np.uint8)
        for dst_idx, src_idx in (([8], [0]), ([0], [9]), ([-1], [0])):
            for d_, s_ in ((a, b), (a[:, :32], b[:, :32])):
                with pytest.raises(IndexError):
                    c.copy_rows(d_, np.array(dst_idx), s_, np.array(src_idx))
                assert not a.any()
    finally:
        c.close()
