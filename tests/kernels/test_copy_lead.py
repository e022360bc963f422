"""A started copy's caller copies the first pieces itself while every helper is still asleep
(``use_lead``), and only then: the bytes are the same whoever copies which piece."""

from __future__ import annotations

import time

import numpy as np
import pytest

copy = pytest.importorskip("kvtier.kernels._copy")

ROW = 256 << 10


def _started_copies(lead: int, rows: int, starts: int, pause_s: float) -> int:
    """Pieces led over ``starts`` started copies of ``rows`` scattered rows, each after a pause
    (helpers asleep); every copy checked byte for byte."""
    rng = np.random.default_rng(lead)
    src = rng.integers(0, 255, rows * ROW, dtype=np.uint8).reshape(rows, ROW)
    previous = copy.use_lead(lead)
    try:
        before = copy.led()
        for k in range(starts):
            dst = np.zeros_like(src)
            src_rows = rng.permutation(rows).astype(np.int64)
            dst_rows = np.arange(rows, dtype=np.int64)[::-1].copy()
            time.sleep(pause_s)
            job = copy.start_rows(dst, src, dst_rows, src_rows, ROW, 1 << 20, 2)
            assert job.join() == rows * ROW
            assert np.array_equal(dst[dst_rows], src[src_rows]), (lead, k)
        return copy.led() - before
    finally:
        copy.use_lead(previous)


def test_a_copy_started_while_the_helpers_sleep_is_led_by_its_caller_and_exact():
    assert _started_copies(0, 256, 6, 0.02) == 0  # off: the caller copies nothing
    led = _started_copies(4, 256, 12, 0.02)
    # each start from idle leads at most 4 pieces; a helper can in principle wake before the
    # caller takes its first piece, but not at every one of twelve starts
    assert 0 < led <= 4 * 12


def test_no_lead_while_a_helper_is_awake_and_bad_counts_are_refused():
    """A copy started while a helper copies an earlier one (256 MiB, ~14 ms, started 5 ms
    before) leads nothing: the copy is not waiting for a helper."""
    rows = 1024
    src = np.ones((rows, ROW), np.uint8)
    dsts = [np.zeros_like(src) for _ in range(2)]
    all_rows = np.arange(rows, dtype=np.int64)
    previous = copy.use_lead(4)
    try:
        second = 0
        for _ in range(6):
            time.sleep(0.02)
            first = copy.start_rows(dsts[0], src, all_rows, all_rows, ROW, 1 << 20, 2)
            time.sleep(0.005)
            before = copy.led()
            later = copy.start_rows(dsts[1], src, all_rows, all_rows, ROW, 1 << 20, 2)
            second += copy.led() - before
            assert first.join() == later.join() == rows * ROW
        assert second == 0
        assert all(bool(d.all()) for d in dsts)
        with pytest.raises(ValueError):
            copy.use_lead(-1)
        assert copy.use_lead(4) == 4  # the refused count changed nothing
    finally:
        copy.use_lead(previous)
