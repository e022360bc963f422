"""Where the median a bench ratio estimates likely lies: a bootstrap over its repetitions.

A headline ratio is the median of per-repetition ratios (raw time / kvtier time),
and on a shared host one repetition's ratio ranges over ~0.4-1.8 (measured here:
the spread of log ratios is ~0.17, whichever baseline is paired, adjacent or not),
so one run's median is itself uncertain by a few hundredths. Resampling the
repetitions says how much: a figure whose interval straddles its target is not
told apart from the target by that run, whichever side its point falls on. The
interval is for the median itself; a rerun's own median spreads wider (about
1.4x), so a rerun may read below a target that an interval clears. The percentile
bootstrap of the worse of several medians reads low, and resampling runs as well
as repetitions counts their spread twice: both err towards caution.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

LEVEL = 0.95
DRAWS = 2000


def median_ratio_interval(samples: Sequence[Sequence[float]], level: float = LEVEL, draws: int = DRAWS,
                          seed: int = 0) -> tuple[float, float]:
    """The central ``level`` interval of min(median of each sample list), each list resampled
    with replacement ``draws`` times (seeded: a rerun on the same samples gives the same bounds).
    Several lists are the several figures one headline is the worse of (two copy directions,
    two block sizes), resampled independently as they were measured."""
    if not samples or any(len(s) == 0 for s in samples):
        raise ValueError("every sample list needs at least one repetition")
    _check_level(level)
    rng = np.random.default_rng(seed)
    worst = np.full(draws, np.inf)
    for s in samples:
        values = np.asarray(s, dtype=np.float64)
        picks = rng.integers(0, values.size, size=(draws, values.size))
        worst = np.minimum(worst, np.median(values[picks], axis=1))
    return _central(worst, level)


def pooled_interval(runs: Sequence[Sequence[Sequence[float]]], level: float = LEVEL, draws: int = DRAWS,
                    seed: int = 0) -> tuple[float, float]:
    """``median_ratio_interval`` for figures pooled over runs: ``runs[i][j]`` is run i's
    repetitions of figure j (empty where that run did not measure it). Each draw resamples
    the runs, then each chosen run's repetitions, so a difference between runs (another
    hour on a shared host) widens the interval. A figure none of a draw's runs measured (a
    block size only some runs had) is left out of that draw's worse-of; every run must
    have measured at least one figure."""
    if not runs or any(len(r) != len(runs[0]) for r in runs) or not runs[0]:
        raise ValueError("every run needs the same figures, at least one")
    if any(all(len(x) == 0 for x in r) for r in runs):
        raise ValueError("a run that measured no figure")
    _check_level(level)
    figures = [[np.asarray(r[j], dtype=np.float64) for r in runs] for j in range(len(runs[0]))]
    if any(all(a.size == 0 for a in fig) for fig in figures):
        raise ValueError("a figure no run measured")
    rng = np.random.default_rng(seed)
    worst = np.empty(draws)
    for d in range(draws):
        copies = np.bincount(rng.integers(0, len(runs), len(runs)), minlength=len(runs))
        medians = []
        for fig in figures:
            got = [a[rng.integers(0, a.size, a.size * c)] for a, c in zip(fig, copies) if c and a.size]
            if got:  # (no chosen run measured it: this draw says nothing of it)
                medians.append(np.median(np.concatenate(got)))
        worst[d] = min(medians)
    return _central(worst, level)


def _check_level(level: float) -> None:
    if not 0.0 < level < 1.0:
        raise ValueError(f"level {level} is not in (0, 1)")


def _central(draws: np.ndarray, level: float) -> tuple[float, float]:
    """The central ``level`` interval of the bootstrap's draws."""
    tail = (1.0 - level) / 2.0
    lo, hi = np.quantile(draws, [tail, 1.0 - tail])
    return float(lo), float(hi)


def rep_ratios(times: dict[str, list[float]], ours: str, raw: str) -> list[float]:
    """Per repetition, raw time / kvtier time (the steps of a repetition ran back to back)."""
    if len(times[ours]) != len(times[raw]):
        raise ValueError(f"{ours} has {len(times[ours])} repetitions and {raw} {len(times[raw])}: not paired")
    return [r / o for o, r in zip(times[ours], times[raw])]


__all__ = ["LEVEL", "DRAWS", "median_ratio_interval", "pooled_interval", "rep_ratios"]
