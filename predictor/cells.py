"""The reuse model's cells and the partitions of them that candidate models condition on.

A cell is what the model knows of an access: feature class x access stage
(``kvtier.predictor.classes``) x the block's last reuse distance (2-octave
buckets, LIRS's IRR). A partition maps every fine cell to a coarser one (the
features a candidate conditions on); ``PARENT`` is the shrinkage hierarchy. One
owner of the layout: the per-access path, ``admit_many`` and the table builder
all compute cells with ``cell_of``. A candidate model is a partition and a horizon;
``DEFAULT_CANDIDATES`` is the grid the shadow caches choose from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from kvtier.predictor.classes import N_CLASSES, N_STAGES, STAGE_OF_COUNT, STAGE_OF_COUNT_ARRAY
from kvtier.predictor.survival import N_BUCKETS

N_IRR = 8  # last reuse distance in 2-octave buckets (0: never reused), a per-block feature (LIRS's IRR)
N_CELLS = N_CLASSES * N_IRR  # cell = (class * N_STAGES + stage) * N_IRR + irr


def cell_of(cls: "int | np.ndarray", count: "int | np.ndarray", irr: "int | np.ndarray") -> "int | np.ndarray":
    """The cell of an access: feature class ``cls``, the block's ``count``-th access (>= 1),
    last reuse distance bucket ``irr``; scalars (the per-access path) or arrays."""
    stage = STAGE_OF_COUNT[count] if isinstance(count, int) else STAGE_OF_COUNT_ARRAY[count]
    return (cls * N_STAGES + stage) * N_IRR + irr
_FINE = np.arange(N_CELLS)
PARTITIONS: dict[str, np.ndarray] = {  # fine cell -> the partition's cell
    "class_stage_irr": _FINE,
    "class_stage": _FINE // N_IRR,
    "stage_irr": (_FINE // N_IRR % N_STAGES) * N_IRR + _FINE % N_IRR,
    "stage": _FINE // N_IRR % N_STAGES,
    "all": np.zeros(N_CELLS, dtype=np.int64),
}
SUM_ROWS: dict[str, Callable[[np.ndarray], np.ndarray]] = {  # fine-cell rows -> partition-cell rows, summed
    "class_stage_irr": lambda a: a,
    "class_stage": lambda a: a.reshape(N_CLASSES, N_IRR, *a.shape[1:]).sum(1),
    "stage_irr": lambda a: a.reshape(N_CLASSES // N_STAGES, N_STAGES * N_IRR, *a.shape[1:]).sum(0),
    "stage": lambda a: a.reshape(N_CLASSES // N_STAGES, N_STAGES, N_IRR, *a.shape[1:]).sum((0, 2)),
    "all": lambda a: a.sum(0, keepdims=True),
}
PARENT = {"class_stage_irr": "class_stage", "class_stage": "stage", "stage_irr": "stage", "stage": "all",
          "all": None}

# partitions whose cells at access stage s > 0 are shrunk towards the same class's stage
# s - 1 (its posterior), not towards the parent partition. Why: the parent pools every
# class and stage by accesses, so its hazard is mostly the hottest blocks' (a shared
# system block read by every request, reused within a few accesses). A block on its second
# access, in a stage with no evidence yet, took that hazard: at the start of a loop's second
# pass it looked more valuable than the first-pass blocks about to come back, and
# displaced them. The previous stage of the same class is the nearest thing known about
# it. Stage 0 keeps the parent prior.
ORDINAL = frozenset({"class_stage"})


def shrink_by_stage(hazard: np.ndarray, reuses: np.ndarray, at_risk: np.ndarray, strength: float) -> None:
    """Re-estimate the (class x stage) rows of ``hazard`` in place, stage by stage, each
    with the same class's previous stage as its prior (``strength`` pseudo-observations)."""
    h = hazard.reshape(-1, N_STAGES, N_BUCKETS)
    r = reuses.reshape(h.shape)
    a = at_risk.reshape(h.shape)
    for stage in range(1, N_STAGES):
        h[:, stage] = np.minimum((strength * h[:, stage - 1] + r[:, stage]) / (strength + a[:, stage]), 1.0)


EXPAND: dict[str, "np.ndarray | None"] = {  # partition cell of each fine cell; None: the same
    name: None if np.array_equal(cmap, _FINE) else cmap for name, cmap in PARTITIONS.items()}


def first_cell_of(cmap: np.ndarray, n_cells: int) -> np.ndarray:
    """For each partition cell, one fine cell that maps to it (to look up its parent)."""
    first = np.zeros(n_cells, dtype=np.int64)
    first[cmap[::-1]] = np.arange(cmap.size)[::-1]
    return first


@dataclass(frozen=True)
class Candidate:
    """One model: which features it conditions on, and its horizon in eviction ages."""

    partition: str
    horizon_multiple: float
    density: bool = False  # value = P(reused within W) / expected slot time until then (hit density)


# The grid the shadow caches choose from: a spread of horizons on the full features,
# coarser feature sets, and two hit-density models with long horizons (a loop longer than
# the cache: P within a short horizon is 0 at mid ages, density keeps rising towards the
# reuse), 32 and 128 eviction ages: a reuse 70x the cache away (a loop at 1%) is beyond
# 32 and was invisible to every candidate. None of it is fitted to a trace: the 128
# replaced a second density model on coarser features, measured on the synthetic families
# and the first half of the conversation trace (docs/placement.md).
DEFAULT_CANDIDATES: tuple[Candidate, ...] = (
    Candidate("class_stage", 1.0), Candidate("class_stage", 2.0), Candidate("class_stage", 4.0),
    Candidate("class_stage", 8.0), Candidate("stage_irr", 4.0), Candidate("class_stage_irr", 4.0),
    Candidate("class_stage_irr", 32.0, density=True), Candidate("class_stage_irr", 128.0, density=True),
)
