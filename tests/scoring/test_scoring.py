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
    s.tag(np.array([5]), "document")
    assert s.score(np.array([5]))[0] == pytest.approx(0.5 * s.ema_value[5])
    assert np.all((s.score(blocks) >= 0) & (s.score(blocks) <= 1))
    w = s.weight(blocks)
    assert np.all(w >= s.importance_floor)


def test_bad_reports_raise_and_change_nothing():
    s = ImportanceScores(4)
    before = s.ema_value.copy()
    with pytest.raises(ValueError):
        s.report(np.array([0, 1]), np.array([1.0]))
    np.testing.assert_array_equal(s.ema_value, before)

