"""kvtier's placement policy: keep the blocks with the highest expected value per slot.

value(b) = P(b is reused within W | its features, its age) x weight(b)

* P is the Beta-Bayesian reuse model (``kvtier.predictor.reuse_model``): a
  posterior per (feature class x access stage, age), shrunk towards coarser
  cells, learned from reuse distances read off the access stream.
* W, the horizon, is a multiple of this cache's own mean eviction age: "reused
  before this cache would forget it". All slots cost the same time W, so the
  probability is the expected hits per slot over the horizon. A density
  candidate divides P by the expected slot time until the reuse or W instead
  (hit density), which keeps rising as a reuse beyond the cache nears.
* weight(b) is set by the daemon: the block's attention importance
  (``set_weights``); 1 in replay. A restore-cost factor is not applied: within
  one tier and one block geometry every victim comes back the same way, so it
  could not change a decision; with engines of mixed geometry it could, and is
  not modelled yet.

Which features to condition on and which multiple of the eviction age to use
are chosen online by shadow caches (``kvtier.policy.shadow``): the workload in
front of the cache picks among a fixed grid of candidates; the shipped config
holds no value fitted to one trace.

Victims: the lowest value among ``samples`` uniformly sampled residents (a
dense resident array: O(1) sampling and removal), one vectorised table lookup
per eviction. Admission uses the same number: a missed block enters only if it
is worth more than the victim it would displace, so blocks that will not be
reused before the cache forgets them never push out ones that will. A tie keeps
the resident: displacing an equal costs a copy and gains nothing, and where the
model cannot tell blocks apart (a loop longer than the cache: every block is
reused at the same distance) admitting on ties cycled the cache like LRU, with
no hits; keeping the incumbents holds a fixed share of the loop, as LIRS does. The same
holds where neither block has evidence of reuse (both below ``evidence_floor``): values
near zero differ only by the prior's shape, which favours the young, and the cache would
cycle through a loop's first pass holding nothing of it when the second began.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from kvtier.policy import register_policy
from kvtier.policy.base import Eligible, Policy, budget, swap_remove, swap_remove_many
from kvtier.policy.shadow import ShadowCaches
from kvtier.policy.value_compiled import Runner, replay_runner
from kvtier.predictor.calibration import CalibrationTracker
from kvtier.predictor.cells import DEFAULT_CANDIDATES, N_IRR, cell_of
from kvtier.predictor.reuse_model import ReuseModel

_HASH = 0x9E3779B1
# every method whose work the replay kernel does itself: overridden (by a subclass or an instance), the kernel
# would not call it, so replay takes the hooks instead
_HOOKS = ("observe", "on_hit", "admit", "evict", "insert", "_record_eviction", "_find_victim", "_sample", "_unlink",
          "_scored", "_predict", "_neither_reused", "_floor_applies")


@register_policy("kvtier")
class ValuePolicy(Policy):
    def __init__(self, capacity: int, max_blocks: int, samples: int = 16, admission: bool = True,
                 prior_strength: float = 2.0, refresh_every: int = 2000, memory_horizons: float = 32.0,
                 shadow_blocks: int = 128, default_candidate: int = 2, evidence_floor: float = 0.01, seed: int = 0,
                 track_calibration: bool = True, calibration_bins: int = 10, calibration_sample: int = 8,
                 calibration_window: Optional[int] = None, recalibrate: bool = True, **_: object) -> None:
        super().__init__(capacity, max_blocks)
        if samples < 1 or not 0 <= default_candidate < len(DEFAULT_CANDIDATES) or calibration_sample < 1 \
                or not 0.0 <= evidence_floor <= 1.0:
            raise ValueError("samples >= 1, calibration_sample >= 1, default_candidate indexes the candidate grid, "
                             "0 <= evidence_floor <= 1")
        self.model = ReuseModel(max_blocks, DEFAULT_CANDIDATES, prior_strength, refresh_every, memory_horizons,
                                initial_age=float(capacity))
        self.shadows = ShadowCaches(capacity, max_blocks, len(DEFAULT_CANDIDATES), shadow_blocks, seed=seed + 1)
        self.default_candidate = int(default_candidate)
        self.active = self.default_candidate
        self.samples = int(samples)
        self.admission = admission
        self.evidence_floor = float(evidence_floor)
        self.weight = np.ones(max_blocks, dtype=np.float32)  # importance (the daemon's)
        self._weighted = False
        self.slots = np.zeros(capacity, dtype=np.int64)  # dense resident list
        self.where = np.full(max_blocks, -1, dtype=np.int32)
        self.rng = np.random.default_rng(seed)
        self._pool = self.rng.integers(0, capacity, size=self.samples * 4096)
        self._pool_at = 0
        self._victim = -1
        self.bypassed = 0
        self.calib: Optional[CalibrationTracker] = None
        self._calibration_window = calibration_window
        self.calibration_sample = int(calibration_sample)
        self.set_calibration(track_calibration, calibration_bins, calibration_sample, recalibrate)

    # -- the value ---------------------------------------------------------
    def _values(self, blocks: np.ndarray) -> np.ndarray:
        v = self.model.values(self.active, blocks)
        if self._weighted:
            v = v * self.weight[blocks]
        return v

    def _scored(self, b: int) -> bool:
        # before the model's first refresh its table is a recency ranking with no evidence
        # behind it, not a probability: there is nothing to score yet
        return self.calib is not None and self.model.refreshes > 0 and not ((b * _HASH) >> 7) % self.calibration_sample

    def _predict(self, b: int, p: float) -> None:
        assert self.calib is not None
        self.calib.predict(b, p, float(self.model.clock), float(self.model.horizons[self.active]), self.active)

    # -- cache hooks ---------------------------------------------------------
    def observe(self, b: int, now: float, cls: int) -> None:
        model = self.model
        if self._scored(b):
            assert self.calib is not None
            self.calib.access(b, float(model.clock + 1))
        if model.access(b, cls):
            self.active = self.shadows.best(self.active)
            self.shadows.decay(0.9)
            if self.calib is not None:
                self.calib.fold(model.clock, model.refresh_decay)
        if self.shadows.sampled(b):
            self.shadows.access(b, model.values_rows, model.values_just_accessed)

    def on_hit(self, b: int, now: float, cls: int, next_use: int) -> None:
        pass  # the model recorded the access in ``observe``

    def _sample(self) -> np.ndarray:
        if self.size <= self.samples:
            return self.slots[: self.size]
        if self._pool_at + self.samples > self._pool.size:
            self._pool = self.rng.integers(0, self.capacity, size=self._pool.size)
            self._pool_at = 0
        r = self._pool[self._pool_at: self._pool_at + self.samples]
        self._pool_at += self.samples
        return self.slots[r if self.size == self.capacity else r % self.size]

    def _find_victim(self) -> tuple[int, float]:
        cand = self._sample()
        i, v = self.model.lowest(self.active, cand, self.weight if self._weighted else None)
        return int(cand[i]), v

    def admit(self, b: int, now: float, cls: int, next_use: int) -> bool:
        if self.size < self.capacity:
            self._victim = -1
            return True
        victim, v_value = self._find_victim()
        self._victim = victim
        p = self.model.value_just_accessed(self.active, b)
        # in float32, as ``_values`` ranks the victim: a tie must compare equal
        mine = float(np.float32(p) * self.weight[b]) if self._weighted else p
        if self._scored(b):
            self._predict(b, self.model.probability_just_accessed(self.active, b))
        if not self.admission or (mine > v_value and not self._neither_reused(b, victim)):
            return True
        self._victim = -1
        self.bypassed += 1
        return False

    def _neither_reused(self, b: int, victim: int) -> bool:
        """Neither the newcomer nor the victim is reused within the horizon with probability
        ``evidence_floor`` or more: their values then differ only by the prior's shape, and
        the resident stays. Why: before any block of a workload has come back (the first
        pass of a loop), values near zero favour young blocks, so the cache cycled like LRU
        and held nothing of the first pass when the second began; keeping the incumbents
        holds a fixed share of it, as LIRS does."""
        if not self._floor_applies():
            return False
        floor, m = self.evidence_floor, self.model
        # in float64 both, as the replay kernel compares
        return (m.probability_just_accessed(self.active, b) < floor
                and float(m.probabilities(self.active, np.array([victim]))[0]) < floor)

    def _floor_applies(self) -> bool:
        """The evidence floor is on and the tables hold probabilities: before the first refresh
        they are the recency ranking (a density model's probabilities are all 0 then)."""
        return self.evidence_floor > 0.0 and self.model.refreshes > 0

    def evict(self, now: float) -> int:
        v = self._victim if self._victim >= 0 else self._find_victim()[0]
        self._victim = -1
        self._record_eviction(v)
        return v

    def _record_eviction(self, v: int) -> None:
        self.model.evicted(v)
        if self._scored(v):
            self._predict(v, float(self.model.probabilities(self.active, np.array([v]))[0]))
        self._unlink(v)

    def insert(self, b: int, now: float, cls: int, next_use: int) -> None:
        self.slots[self.size] = b
        self.where[b] = self.size
        self.size += 1

    def insert_many(self, blocks: np.ndarray, now: float, classes: np.ndarray) -> None:
        """``insert`` of each block in order, as one append."""
        k = int(blocks.size)
        self.slots[self.size: self.size + k] = blocks
        self.where[blocks] = np.arange(self.size, self.size + k)
        self.size += k

    def _unlink(self, b: int) -> None:
        self.size = swap_remove(self.slots, self.where, self.size, b)

    def remove(self, b: int) -> None:
        self._unlink(b)

    def remove_many(self, blocks: np.ndarray) -> None:
        if type(self)._unlink is not ValuePolicy._unlink or "_unlink" in vars(self):  # an override sees each
            super().remove_many(blocks)
        else:
            self.size = swap_remove_many(self.slots, self.where, self.size, blocks)

    # -- queries for the daemon ---------------------------------------------
    def victims(self, n: int, eligible: Optional[Eligible] = None) -> np.ndarray:
        """Up to ``n`` eligible residents, lowest value first, among ``samples`` x ``n``
        sampled by a local generator (all residents when there are no more). No state
        changes: this policy's generator and pool are untouched."""
        if n <= 0 or self.size == 0:
            return np.zeros(0, dtype=np.int64)
        m = min(self.samples * n, budget(n) * 4)
        if self.size <= m:
            cand = self.slots[: self.size].copy()
        else:
            rng = np.random.default_rng((self.model.clock, self.size, n))
            cand = np.unique(self.slots[rng.integers(0, self.size, size=m)])
        if eligible is not None:
            cand = cand[np.asarray(eligible(cand), dtype=bool)]
        return cand[np.argsort(self._values(cand), kind="stable")[:n]]

    def on_evict(self, b: int, now: float) -> None:
        """The daemon evicted ``b`` (one ``victims`` returned): record it as ``evict`` would."""
        if self._victim == b:
            self._victim = -1
        self._record_eviction(b)

    def admit_many(self, blocks: np.ndarray, classes: np.ndarray) -> np.ndarray:
        """Which offered blocks are worth a slot here: their value now (feature class
        ``classes``, their access stage and age) at least the lowest of a fresh sample
        of residents, what the next eviction would take (a tie declines). No state changes."""
        ok = np.ones(blocks.size, dtype=bool)
        if not self.admission or self.size < self.samples or blocks.size == 0:
            return ok
        sample = self.slots[np.random.default_rng(self.model.clock).integers(0, self.size, size=self.samples)]
        values = self._values(sample)
        lowest = int(np.argmin(values))
        model, k = self.model, self.active
        # an offered block was accessed (count >= 1); its reuse distance bucket is its cell's
        cells = cell_of(classes.astype(np.int64), np.maximum(model.count[blocks], 1), model.cell[blocks] % N_IRR)
        ages = model.age_buckets(blocks)
        mine = model.tables[k][cells, ages]
        if self._weighted:
            mine = mine * self.weight[blocks]
        out = np.asarray(mine > float(values[lowest]))  # a tie keeps the residents, as ``admit``
        if self._floor_applies() and float(model.probabilities(k, sample[lowest: lowest + 1])[0]) < self.evidence_floor:
            out &= model.probability_table(k)[ages, cells] >= self.evidence_floor  # neither reused, as ``admit``
        return out

    def best(self, k: int) -> np.ndarray:
        """Up to ``k`` of ``4k`` sampled residents with the highest value (speculative promotion)."""
        if self.size == 0 or k <= 0:
            return np.zeros(0, dtype=np.int64)
        cand = np.unique(self.slots[np.random.default_rng(self.model.clock).integers(
            0, self.size, size=min(4 * k, 4 * self.size))])
        return cand[np.argsort(-self._values(cand), kind="stable")[:k]]

    def compiled_replay(self, blocks: np.ndarray, classes: np.ndarray, resident: np.ndarray) -> Optional[Runner]:
        """Replay's loop over this policy in compiled code, with the same decisions
        (``kvtier.policy.value_compiled``); None where it cannot serve, and where a method the
        kernel does itself is overridden (``_HOOKS``: by a subclass or an instance) or the model
        is not a ``ReuseModel``: the kernel would not call them."""
        cls = type(self)
        if (any(getattr(cls, h) is not getattr(ValuePolicy, h) for h in _HOOKS) or any(h in vars(self) for h in _HOOKS)
                or type(self.model) is not ReuseModel):
            return None
        return replay_runner(self, blocks, classes, resident)

    def residents(self) -> np.ndarray:
        return self.slots[: self.size].copy()

    def set_weights(self, blocks: np.ndarray, weights: np.ndarray) -> None:
        self.weight[blocks] = weights
        self._weighted = True

    def on_freed(self, b: int) -> None:
        """Block id ``b`` no longer exists: the next block to take the id starts afresh
        (no access history, weight or pending prediction)."""
        self.model.reset(b)
        self.shadows.forget(b)
        self.weight[b] = 1.0
        if self.calib is not None:
            self.calib.on_freed(b)

    def configure(self, params: dict) -> None:
        """Reloaded ``[policy]`` parameters that apply to a running model: admission and its
        evidence floor, the victim sample, the shrinkage and the memory (read at each refresh). The grid's refresh period,
        shadow size and first candidate are built in; the daemon reports those as restart-only."""
        if "samples" in params and int(params["samples"]) < 1:
            raise ValueError("samples >= 1")
        floor = float(params.get("evidence_floor", self.evidence_floor))
        if not 0.0 <= floor <= 1.0:
            raise ValueError("0 <= evidence_floor <= 1")
        strength = float(params.get("prior_strength", self.model.m))
        if not strength > 0:  # (0: a cell with no evidence is 0/0, NaN); checked before anything is applied
            raise ValueError("prior_strength must be > 0")
        self.evidence_floor = floor
        self.admission = bool(params.get("admission", self.admission))
        self.samples = int(params.get("samples", self.samples))
        self.model.m = strength
        self.model.memory_horizons = float(params.get("memory_horizons", self.model.memory_horizons))

    def set_calibration(self, track_calibration: bool, calibration_bins: int, calibration_sample: int,
                        recalibrate: bool) -> None:
        """The ``[predictor]`` settings, at start and on a reload. The probabilities stated for
        decisions are recalibrated online, per candidate model (``kvtier.predictor.recalibration``);
        decisions rank by the model's own. A changed tracker starts afresh (its pairs and map
        were scored under the old settings); the sample rate applies to the next decision."""
        if calibration_sample < 1:
            raise ValueError("calibration_sample >= 1")
        self.calibration_sample = int(calibration_sample)
        c = self.calib
        if (c is not None) == bool(track_calibration) and (c is None or (
                c.n_bins == calibration_bins and (c.recal is not None) == bool(recalibrate))):
            return
        self.calib = (CalibrationTracker(self.model.last.size, calibration_bins, self._calibration_window,
                                         recalibrate_period=self.model.refresh_every if recalibrate else None,
                                         models=len(DEFAULT_CANDIDATES))
                      if track_calibration else None)

    def seen(self, b: int) -> bool:
        return bool(self.model.count[b])

    def seen_many(self, blocks: np.ndarray) -> np.ndarray:
        return self.model.count[blocks] != 0

    def calibration(self) -> Optional[dict]:
        """Brier and ECE of the decisions taken (admissions and evictions, sampled), over
        the predictions whose window has closed."""
        if self.calib is None:
            return None
        now = float(self.model.clock)
        self.calib.finish(now)
        return self.calib.summary(now)

    def stats(self) -> dict:
        c = DEFAULT_CANDIDATES[self.active]
        return {"bypassed": self.bypassed, "model": f"{c.partition} x{c.horizon_multiple:g}",
                "horizon_accesses": float(self.model.horizons[self.active]),
                "eviction_age_accesses": self.model.eviction_age,
                "shadow_hits": self.shadows.hits.round(1).tolist()}


__all__ = ["ValuePolicy"]
