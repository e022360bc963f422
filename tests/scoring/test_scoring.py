"""Importance scores and the Quest upper bound."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.scoring.importance import ImportanceScores


def test_ema_of_normalised_mass():
    s = ImportanceScores(8, ema=0.5, importance_floor=0.0, segment_weights={})
    blocks = np.array([0, 1, 2, 3])
    s.report(blocks, np.array([4.0, 2.0, 1.0, 1.0]))  # shares x 4 = 2, 1, .5, .5 -> clipped
    np.testing.assert_allclose(s.ema_value[:4], [1.0, 1.0, 0.5, 0.5])
    s.report(blocks, np.array([0.0, 0.0, 0.0, 8.0]))
    np.testing.assert_allclose(s.ema_value[:4], [0.5, 0.5, 0.25, 0.75])
    assert s.reports[:4].tolist() == [2, 2, 2, 2]


def test_structural_priors_and_segments():
    s = ImportanceScores(8, sink_blocks=1, recency_blocks=2, recency_floor=0.6,
                        segment_weights={"system": 1.0, "document": 0.5})
    blocks = np.arange(6)
    s.report(blocks, np.zeros(6) + 1e-9)  # uniform: everyone gets a fair share
    s.report(blocks, np.array([0, 0, 0, 0, 0, 1.0]))
    score = s.score(blocks, position=np.arange(6), seq_len_blocks=np.full(6, 6))
    assert score[0] == 1.0  # attention sink
    assert score[4] >= 0.6  # recency window
    s.tag(np.array([3]), "document")  # block 3: neither sink nor recent
    assert s.score(np.array([3]))[0] == pytest.approx(0.5 * s.ema_value[3])
    assert np.all((s.score(blocks) >= 0) & (s.score(blocks) <= 1))
    w = s.weight(blocks)
    assert np.all(w >= s.importance_floor)


def test_a_report_s_places_give_the_priors_and_weights_scale_only_the_attention():
    """A report is one sequence's blocks in order: its first blocks are sinks (1), its last
    ``recency_blocks`` at least ``recency_floor``, whatever mass they got and whatever their
    segment weighs; a daemon scores them later without positions."""
    s = ImportanceScores(16, ema=1.0, sink_blocks=1, recency_blocks=2, recency_floor=0.5,
                         segment_weights={"document": 0.25})
    blocks = np.array([9, 3, 7, 1, 12])  # ids say nothing of places
    s.tag(blocks, "document")
    s.report(blocks, np.array([0, 0, 1.0, 0, 0]))  # a decode step's mass on the middle block
    np.testing.assert_allclose(s.score(blocks), [1.0, 0.0, 0.25, 0.5, 0.5], atol=1 / 255)  # priors in 255ths
    s.report(blocks[:4], np.ones(4))  # the sequence seen shorter: block 7 is recent now
    np.testing.assert_allclose(s.score(blocks[:4]), [1.0, 0.25, 0.5, 0.5], atol=1 / 255)
    assert np.all(s.score(blocks[2:4]) >= 0.5)  # a floor, never under it
    s.forget(blocks)
    np.testing.assert_allclose(s.score(blocks), 0.5)  # a recycled id: unknown, neutral


def test_a_report_s_shares_count_the_blocks_it_does_not_update():
    """Blocks the daemon drops from a report (freed, another namespace's) still count in
    the shares of the rest: 1% of the attention stays 1%."""
    s = ImportanceScores(8, ema=1.0)
    keep = np.array([True, True, True, False])
    s.report(np.array([0, 1, 2, 3]), np.array([1.0, 1.0, 1.0, 97.0]), keep=keep)
    np.testing.assert_allclose(s.ema_value[:4], [0.04, 0.04, 0.04, 0.0], rtol=1e-5)
    assert s.reports[:4].tolist() == [1, 1, 1, 0]


def test_bad_reports_raise_and_change_nothing():
    s = ImportanceScores(4)
    before = s.ema_value.copy()
    with pytest.raises(ValueError):
        s.report(np.array([0, 1]), np.array([1.0]))
    np.testing.assert_array_equal(s.ema_value, before)

