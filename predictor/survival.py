"""Reuse-distance survival arithmetic for the reuse model: half-octave distance buckets,
survival curves from per-bucket hazards, the probability of a reuse within a window, and
hit density. Pure functions over ``[edge or bucket, cell]`` arrays, writing into buffers
their caller owns (``kvtier.predictor.reuse_model``): a refresh rebuilds every table from
them without allocating.
"""

from __future__ import annotations

import math

import numpy as np

N_BUCKETS = 48  # half octaves: the last one, from 2^23.5 accesses, takes every longer distance
EDGES = 2.0 ** (np.arange(N_BUCKETS + 1) / 2.0)  # distance bucket j covers [EDGES[j], EDGES[j + 1])
EDGES[-1] = np.inf  # the last bucket takes every longer distance
WIDTHS = np.append(np.diff(EDGES[:-1]), 0.0)  # bucket widths; the open last one only ever partly
# the span over which a bucket's hazard is spread when survival is interpolated: its width, and
# for the open last one the width it would have (its hazard spent by 2^24, survival flat after)
SPANS = EDGES[:-1] * (math.sqrt(2.0) - 1.0)


def distance_bucket(d: np.ndarray) -> np.ndarray:
    """Bucket of distances ``d`` >= 1 (vectorised): floor(2 log2 d), capped."""
    out = (2.0 * np.log2(np.maximum(d, 1))).astype(np.int64)
    return np.minimum(out, N_BUCKETS - 1)


def log_survival(hazard: np.ndarray) -> np.ndarray:
    """log P(not reused by the end of distance bucket j-1), per (partition) cell; column 0 is 0."""
    return np.concatenate((np.zeros((hazard.shape[0], 1)),
                           np.cumsum(np.log1p(-np.minimum(hazard, 1 - 1e-12)), axis=1)), axis=1)


def log_survival_slopes(log_surv_t: np.ndarray) -> np.ndarray:
    """d log S / d distance inside each bucket, ``[bucket, cell]``: a constant hazard per access
    within a bucket's span (``SPANS``; the open last one's hazard is spent over the width it
    would have, survival flat after it: dropping it lost every reuse beyond 2^23.5 accesses)."""
    slopes = np.zeros_like(log_surv_t)  # a row per edge; the buckets are rows 0 .. N_BUCKETS - 1
    np.divide(log_surv_t[1:] - log_surv_t[:-1], SPANS[:, None], out=slopes[:-1])
    return slopes


def log_survival_at(log_surv_t: np.ndarray, slopes: np.ndarray, x: np.ndarray, out: np.ndarray,
                     step: np.ndarray) -> np.ndarray:
    """``out[i, cell]`` = log P(next reuse distance >= ``x[i]``) per (partition) cell, from the
    survival at the bucket edges (``log_surv_t[edge, cell]``), log-linear within a bucket;
    all of one dtype; ``step``: scratch of at least ``out.size`` (the reuse model's doc: why
    not at the edges)."""
    j = distance_bucket(x)
    step = step[: out.size].reshape(out.shape)
    np.take(log_surv_t, j, axis=0, out=out, mode="clip")  # "raise" would buffer out: 5x slower
    np.take(slopes, j, axis=0, out=step, mode="clip")
    step *= np.minimum(x - EDGES[j], SPANS[j]).astype(out.dtype)[:, None]  # past 2^24: flat
    out += step
    return out


def window_probabilities(log_surv_t: np.ndarray, slopes: np.ndarray, at_start: np.ndarray,
                          end: np.ndarray, out: np.ndarray, step: np.ndarray) -> np.ndarray:
    """``out[i, cell]`` = P(reused before distance ``end[i]`` | not reused before the age of
    row ``i``) per (age, partition cell): 1 - S(end) / S(start), ``at_start`` = log S(start).
    In the tables' float32: a refresh rebuilds 256 ages x 768 cells for each candidate, and
    float64 passes over them had cost replay ~10% of its speed. (``exp``, not ``expm1``:
    numpy's ``expm1`` is scalar, several times slower.)"""
    log_survival_at(log_surv_t, slopes, end, out=out, step=step)
    out -= at_start
    np.exp(out, out=out)
    np.subtract(1.0, out, out=out)
    np.maximum(out, 0.0, out=out)  # float32 rounding across a bucket edge can leave -1e-6
    return out


def hit_density(log_surv_t: np.ndarray, lo: np.ndarray, w: float, p: np.ndarray, cmap: "np.ndarray | None",
                out: np.ndarray, scratch: np.ndarray, chunk: int) -> None:
    """Hit density (LHD's measure) within the horizon, written into ``out[age, fine cell]``:
    P(reused within ``w``) (``p``, per partition cell) over the expected accesses the block
    holds its slot until reused or ``w`` passes. Unlike P alone it keeps rising as a block
    nears a reuse farther off than ``w`` (a loop longer than the cache): the block that is
    closest to its reuse is worth most.

    The slot time is the integral of survival over the window [lo, lo + w) (``lo``: each
    age's start, in distances): whole buckets inside it from a cumulative sum, the two
    partial buckets at its ends by their overlap; row gathers only (a BLAS matmul here spun
    its threads on every refresh). Computed per partition cell in float64, ``chunk`` ages at
    a time (``scratch``: 3 rows of at least ``chunk`` x cells), expanded to fine cells by
    ``cmap`` and rounded when written."""
    hi = lo + w
    s, e = distance_bucket(lo), distance_bucket(hi)
    # [bucket edge, cell]: survival to the start of each bucket, floored at e^-600 (no block
    # lives that long: below it only subnormal arithmetic, 100x slower, would follow)
    surv_t = np.exp(np.maximum(log_surv_t, -600.0))
    mean_t = 0.5 * (surv_t[:-1] + surv_t[1:])  # [bucket, cell]: within each bucket (trapezoid)
    n_cells = log_surv_t.shape[1]
    cum_t = np.zeros((N_BUCKETS + 1, n_cells))
    np.cumsum(mean_t * WIDTHS[:, None], axis=0, out=cum_t[1:])
    same = s == e
    after_first = np.where(same, e, s + 1)  # whole buckets: [after_first, e), none when same
    first = np.where(same, hi, EDGES[after_first]) - lo
    last = np.where(same, 0.0, hi - EDGES[e])
    for a in range(0, lo.size, chunk):
        z = slice(a, a + chunk)
        n = len(s[z])
        # reused scratch (fresh MBs fault in page by page)
        held, part, diff = (x[:n * n_cells].reshape(n, n_cells) for x in scratch)
        np.take(mean_t, s[z], axis=0, out=held, mode="clip")
        held *= first[z, None]
        np.take(mean_t, e[z], axis=0, out=part, mode="clip")
        part *= last[z, None]
        held += part
        np.take(cum_t, e[z], axis=0, out=part, mode="clip")
        np.take(cum_t, after_first[z], axis=0, out=diff, mode="clip")
        part -= diff  # the difference first: both terms can be far larger than the
        held += part  # partial buckets held so far (survival long gone to ~0)
        np.take(surv_t, s[z], axis=0, out=part, mode="clip")
        np.maximum(part, 1e-300, out=part)
        held /= part
        np.maximum(held, 1.0, out=held)
        np.divide(p[z], held, out=held)
        if cmap is None:
            out[z] = held
        else:
            out[z] = held[:, cmap]


_ROW_KEY = np.random.default_rng(0x5EED).random(N_BUCKETS) + 0.5  # fixed weights: a row's key


def distinct_rows(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct rows of ``a``, the row of them each row of ``a`` is): rows grouped by a
    weighted sum (no sort of whole rows: ``np.unique(axis=0)`` cost a refresh 5 ms), then
    checked equal; keys shared by unequal rows (or NaN) keep every row as it is."""
    key = (a * _ROW_KEY).sum(axis=1)
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    if not np.array_equal(a[first][inverse], a):
        return a, np.arange(a.shape[0])
    return a[first], inverse
