"""Replay's per-access loop of the value policy in compiled code (``kernels/_replay.c``).

``ValuePolicy`` in Python is the reference and stays the only owner of its state:
this module lends the kernel that state's arrays and scalars for one run of
accesses and writes the scalars back. The kernel takes every access that needs
nothing but table lookups and counts, and stops before one that rebuilds the
model's tables, refills a pool of random positions or would touch an index it
cannot check (corrupt state is never read or written there); ``simulate`` gives
that access to the Python hooks and calls again. So
every decision, count and calibration pair is the one the Python path makes (a
test replays the synthetic families both ways and compares the whole state), at
well under a microsecond an access instead of ~25.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import numpy as np

from kvtier.predictor.cells import N_CELLS, N_IRR
from kvtier.predictor.classes import MAX_COUNT, N_STAGES, STAGE_OF_COUNT
from kvtier.predictor.recalibration import BINS, RING
from kvtier.predictor.reuse_model import DECAY_RING, N_AGES
from kvtier.predictor.survival import N_BUCKETS

try:
    from kvtier.kernels._replay import run as _run
except ImportError:  # pragma: no cover - exercised where the extension was not built
    _run = None

if TYPE_CHECKING:
    from kvtier.policy.value import ValuePolicy

Runner = Callable[[int, int], "tuple[int, int]"]

STAGED_PAIRS = 4096  # calibration pairs a run may stage before the tracker takes them
_STAGE_OF_COUNT = np.asarray(STAGE_OF_COUNT, dtype=np.int64)
_HASH_INPUT_LIMIT = 1 << 31  # the kernel hashes block ids in 64-bit arithmetic; Python's ints are exact
# how CalibrationTracker's ``now <= deadline[b]`` compares a Python float with a float32
# element: in float32 under numpy >= 2 (NEP 50), in float64 under numpy 1.x
_FLOAT32_COMPARE = int(bool(16777217.0 <= np.array([16777216.0], dtype=np.float32)[0]))


def available() -> bool:
    return _run is not None


def replay_runner(policy: "ValuePolicy", blocks: np.ndarray, classes: np.ndarray,
                  resident: np.ndarray) -> Optional[Runner]:
    """``run(start, stop) -> (next, hits)`` over ``policy``'s state, or None where the
    kernel was not built, the policy is weighted (the daemon's case, not replay's) or the
    arrays do not cover the policy's block ids one to one."""
    n = policy.model.last.size
    if (_run is None or policy._weighted or n >= _HASH_INPUT_LIMIT or resident.dtype != np.bool_
            or not resident.flags.c_contiguous or resident.size != n or blocks.size != classes.size
            or blocks.dtype.kind not in "iu" or classes.dtype.kind not in "iu"
            or int(resident.sum()) != policy.size or not resident[policy.slots[: policy.size]].all()
            or (policy.calib is not None and policy.calib.recal is not None
                and policy.calib.recal.models != policy.shadows.k)):
        return None  # the hooks serve (and raise what they raise)
    blocks = np.ascontiguousarray(blocks, dtype=np.int64)
    classes = np.ascontiguousarray(classes, dtype=np.int64)
    staged_p = np.zeros(STAGED_PAIRS)
    staged_y = np.zeros(STAGED_PAIRS, dtype=np.uint8)
    staged_d = np.zeros(STAGED_PAIRS, dtype=np.float32)
    no_floats = np.zeros(0, dtype=np.float32)
    no_doubles = np.zeros(0)
    no_bytes = np.zeros(0, dtype=np.uint8)

    def run(start: int, stop: int) -> tuple[int, int]:
        model, shadows, calib = policy.model, policy.shadows, policy.calib
        recal = calib.recal if calib is not None else None
        k = policy.active
        prob = model.prob.get(k)
        shadow_size = np.asarray(shadows.size, dtype=np.int64)
        scored = calib is not None and model.refreshes > 0
        ints = np.array([
            model.clock, policy.size, policy._pool_at, shadows._at, policy.bypassed, 0,
            model.refresh_every, k, policy.capacity, policy.samples, int(policy.admission), shadows.threshold,
            shadows.capacity, shadows.samples, shadows.k, int(scored), policy.calibration_sample, N_AGES,
            N_CELLS, N_STAGES, N_IRR, N_BUCKETS, DECAY_RING, MAX_COUNT, _FLOAT32_COMPARE, int(recal is not None),
            BINS, RING, recal.period if recal else 1, recal.folded if recal else 0,
            recal.untracked if recal else 0], dtype=np.int64)
        floats = np.array([model._decayed, model._log_decay, model._inv_g, float(model.horizons[k]),
                           model._ev_sum, model._ev_n,
                           policy.evidence_floor if policy._floor_applies() else 0.0])  # fixed between refreshes
        arrays = (blocks, classes, resident, model.last, model.count, model.cell, model.reuses, model.accesses,
                  model._period_start, model.table3, model.table3[k] if prob is None else prob, _STAGE_OF_COUNT,
                  policy.slots, policy.where, policy._pool, shadows.member, shadows.slots, shadow_size,
                  shadows.hits, shadows._pool, calib.pred if calib is not None else no_floats,
                  calib.deadline if calib is not None else no_floats, staged_p, staged_y, staged_d,
                  calib.pending_code if calib is not None and recal else no_bytes,
                  recal.floor if recal else no_floats, recal.ceiling if recal else no_floats,
                  recal.due_n if recal else no_doubles, recal.due_p if recal else no_doubles,
                  recal.reused if recal else no_doubles)
        try:
            nxt, hits = _run(arrays, ints, floats, start, stop)
        finally:  # the registers hold every access taken, also where the kernel raised
            model.clock, policy.size, policy._pool_at, shadows._at, policy.bypassed = (int(v) for v in ints[:5])
            model._ev_sum, model._ev_n = float(floats[4]), float(floats[5])
            if recal is not None:
                recal.untracked = int(ints[-1])
            shadows.size = shadow_size.tolist()
            n = int(ints[5])
            if n and calib is not None:
                calib.pairs.extend(staged_p[:n], staged_y[:n], staged_d[:n])
        if nxt > start:
            policy._victim = -1  # as every access through the hooks leaves it
        return int(nxt), int(hits)

    return run


__all__ = ["available", "replay_runner", "Runner"]
