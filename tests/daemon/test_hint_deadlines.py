"""Hint deadlines in 4 bytes a block: within 1/16 s of what was asked, across rebases."""

from __future__ import annotations

import numpy as np

from kvtier.daemon.hint_deadlines import REBASE_S, HintDeadlines


def test_deadlines_hold_to_a_sixteenth_of_a_second_for_years_of_clock():
    """A daemon up for years (a monotonic clock far past the base, crossing the rebase
    point again and again): every deadline still ends within 1/16 s of when it was asked
    to, a block not hinted is always past its deadline, and a cleared one at once."""
    rng = np.random.default_rng(7)
    start = 12345.678
    d = HintDeadlines(8, start)
    now = start
    for _ in range(400):
        now += float(rng.uniform(0, REBASE_S / 3))  # ~3 years of uptime in all
        asked = now + float(rng.uniform(0.05, 30.0))
        blocks = np.array([1, 4])
        d.extend(blocks, asked)
        assert np.all(np.abs(d[blocks] - asked) <= 1 / 16)
        assert not d.passed(blocks, now).any()  # protected now
        assert d.passed(blocks, asked + 1 / 16).all()  # and no longer once it is due
        assert d.passed(np.array([0, 2, 7]), now).all()  # never hinted
        d.extend(np.array([4]), asked - 10.0)  # an earlier deadline never shortens a later one
        assert not d.passed(4, asked - 1.0)
        d.clear(blocks)
        assert d.passed(blocks, now).all()
    assert d.base > start + REBASE_S  # it did move
    assert d.until.dtype == np.float32 and d.until.nbytes == 8 * 4


def test_a_rebase_keeps_pending_deadlines_and_passed_ones_passed():
    d = HintDeadlines(4, 0.0)
    d.extend(np.array([0]), 100.0)  # long passed by the time of the rebase
    late = REBASE_S + 5.0
    d.extend(np.array([1]), late + 20.0)  # this one moves the base
    assert d.base > 0.0
    assert d.passed(0, late) and not d.passed(1, late) and d.passed(1, late + 20.1)
    assert abs(float(d[1]) - (late + 20.0)) <= 1 / 16 and float(d[0]) <= late


def test_a_clock_read_before_the_base_finds_unhinted_blocks_passed():
    """A settable clock set back behind the base (tests do it): a block never hinted is
    still no hinted block, so victim selection keeps finding it."""
    d = HintDeadlines(4, 1000.0)
    assert d.passed(np.array([0, 1, 2, 3]), 999.0).all()
    d.extend(np.array([1]), 1005.0)
    assert d.passed(np.array([0, 2]), 999.0).all() and not d.passed(1, 999.0)
