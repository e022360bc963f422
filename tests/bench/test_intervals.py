"""The bootstrap interval around a bench's median ratio: exact where the answer is known."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.bench.intervals import median_ratio_interval, rep_ratios


def test_identical_repetitions_leave_no_doubt():
    assert median_ratio_interval([[0.93] * 7]) == (0.93, 0.93)


def test_interval_holds_the_median_and_a_rerun_gives_the_same_bounds():
    reps = np.random.default_rng(5).lognormal(np.log(0.93), 0.17, 18).tolist()
    lo, hi = median_ratio_interval([reps])
    assert lo < float(np.median(reps)) < hi
    assert (lo, hi) == median_ratio_interval([reps])
    assert min(reps) <= lo and hi <= max(reps)


def test_the_worse_figure_decides_and_a_far_better_one_changes_nothing():
    worse = np.random.default_rng(6).lognormal(np.log(0.9), 0.2, 12).tolist()
    assert median_ratio_interval([worse, [5.0] * 12]) == median_ratio_interval([worse])
    both = median_ratio_interval([worse, worse])  # the worse of two equal figures reads lower
    alone = median_ratio_interval([worse])
    assert both[0] <= alone[0] and both[1] <= alone[1] and both != alone


def test_more_repetitions_narrow_the_interval():
    draw = np.random.default_rng(7).lognormal(np.log(0.93), 0.17, 72).tolist()
    lo, hi = median_ratio_interval([draw[:18]])
    lo4, hi4 = median_ratio_interval([draw])  # four times the repetitions, new ones
    assert hi4 - lo4 < (hi - lo) * 0.75


def test_the_interval_holds_the_true_median_about_as_often_as_it_says():
    rng = np.random.default_rng(8)
    held = 0
    for seed in range(200):  # runs of 18 repetitions from a known distribution (true median 0.93)
        lo, hi = median_ratio_interval([rng.lognormal(np.log(0.93), 0.17, 18).tolist()], draws=500, seed=seed)
        held += lo <= 0.93 <= hi
    assert 0.88 * 200 <= held <= 200  # a percentile bootstrap of a median of 18 covers ~93-97%


def test_rep_ratios_pair_each_repetition_and_refuse_unpaired_ones():
    times = {"ours": [2.0, 4.0], "raw": [1.0, 3.0], "short": [1.0]}
    assert rep_ratios(times, "ours", "raw") == [0.5, 0.75]
    with pytest.raises(ValueError, match="not paired"):
        rep_ratios(times, "ours", "short")


@pytest.mark.parametrize("samples, level", [([], 0.95), ([[1.0], []], 0.95), ([[1.0]], 1.0), ([[1.0]], 0.0)])
def test_bad_input_is_refused(samples, level):
    with pytest.raises(ValueError):
        median_ratio_interval(samples, level=level)
