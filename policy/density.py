"""kvtier's placement policy: keep the blocks expected to earn the most hits per slot-time.

A block's value is its expected future hits divided by the expected slot-time
it will still occupy, estimated per (block class, age) from this cache's own
history of hits and evictions (Beckmann et al., "LHD", NSDI '18). Dividing by
occupancy is what makes admission automatic: a block class that is rarely
reused, or reused only after the cache would have forgotten it, has a low
density from age 0 and leaves at the next eviction, while a hot class is kept
for as long as its hits keep coming. Nothing is tuned per trace or capacity:
ages are in accesses, coarsened by a granularity that follows the cache's own
mean eviction age, and the tables are exponentially decayed.

Victims: the lowest density among a fixed number of uniformly sampled
residents (a dense index array gives O(1) sampling and removal), one
vectorised table lookup per eviction. The daemon multiplies a block's density
by its importance weight (``weight``, 1 in replay).

Why not rank by the Beta predictor's P(reuse within H) directly (the
``kvtier-beta`` policy)? Measured on the Mooncake conversation trace, that
ranking wins at 1-2% capacity but collapses at 10-20% (0.21/0.31 against LRU's
0.28/0.34): a probability says nothing about how long a block will hold its
slot before the reuse comes. Hit density divides by exactly that. The Beta
predictor still runs alongside (``track_calibration``) for the calibration
report and the daemon's metrics.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from kvtier.policy import register_policy
from kvtier.policy.base import Eligible, Policy
from kvtier.predictor.classes import N_CLASSES, N_STAGES, stage_class
from kvtier.predictor.online import OnlineReusePredictor


@register_policy("kvtier")
class HitDensityPolicy(Policy):
    def __init__(self, capacity: int, max_blocks: int, age_buckets: int = 128, samples: int = 16,
                 reconfigure_every: int = 4000, table_decay: float = 0.9, admission: bool = True,
                 explore_every: int = 16, seed: int = 0, track_calibration: bool = True,
                 epoch_s: float = 1.0, forgetting: float = 0.99999, prior_window_epochs: float = 2048.0,
                 prior_refit_every: int = 2000, prior_shrink: float = 50.0, horizon_init_epochs: float = 64.0,
                 horizon_smoothing: float = 0.01, calibration_bins: int = 10,
                 calibration_window: Optional[int] = None, calibration_sample: int = 8,
                 shrink_events: float = 30.0, **_: object) -> None:
        super().__init__(capacity, max_blocks)
        if samples < 1 or age_buckets < 4 or not 0 < table_decay <= 1 or explore_every < 1:
            raise ValueError("samples >= 1, age_buckets >= 4, 0 < table_decay <= 1 and explore_every >= 1 required")
        # the Beta predictor: calibration report and the daemon's metrics (not the ranking)
        # it follows a 1-in-``calibration_sample`` subset of blocks (by id hash): the same
        # calibration statistics at a fraction of the per-access cost
        self.pred = OnlineReusePredictor(max_blocks, epoch_s, forgetting, prior_window_epochs, prior_refit_every,
                                         prior_shrink, horizon_init_epochs, True, calibration_bins,
                                         calibration_window, calibration_sample) if track_calibration else None
        self.calib = self.pred.calib if self.pred is not None else None
        self.model = self.pred.model if self.pred is not None else None
        self.smoothing = float(horizon_smoothing)
        self.weight = np.ones(max_blocks)  # importance weight (the daemon sets it; 1 in replay)
        self.A = int(age_buckets)
        self.samples = int(samples)
        self.reconfigure_every = int(reconfigure_every)
        self.table_decay = float(table_decay)
        self.rng = np.random.default_rng(seed)
        self._pool = self.rng.integers(0, capacity, size=self.samples * 4096)  # positions in a full cache
        self._pool_at = 0
        self.hits = np.zeros((N_CLASSES, self.A))
        self.evictions = np.zeros((N_CLASSES, self.A))
        self.density = np.zeros((N_CLASSES, self.A))
        self.density[:] = np.linspace(1.0, 0.0, self.A)  # before any evidence: LRU-like
        self._flat = self.density.reshape(-1)
        self.granularity = max(1.0, capacity / (self.A / 4))  # replaced by the measured eviction age
        self._inv_g = 1.0 / self.granularity
        self._weighted = False  # no importance weights set (replay): skip the multiply
        self.clock = 0
        self.ts = np.zeros(max_blocks, dtype=np.int64)
        self.klass = np.zeros(max_blocks, dtype=np.int32)
        self.klass_row = np.zeros(max_blocks, dtype=np.int64)  # klass * A: the row offset in the flat table
        self.accesses = np.zeros(max_blocks, dtype=np.int32)
        self.slots = np.zeros(capacity, dtype=np.int64)  # dense resident list
        self.where = np.full(max_blocks, -1, dtype=np.int64)
        self.admission = admission
        self.shrink_events = float(shrink_events)
        self.explore_every = int(explore_every)
        self.bypassed = 0
        self._victim = -1
        self._victim_bucket = 0
        self._prev_klass = 0
        self._evict_age_sum = 0.0
        self._evict_n: float = 0  # decays by table_decay at each reconfigure
        self._since = 0

    def _bucket(self, age: "int | np.ndarray") -> "int | np.ndarray":
        b = (np.asarray(age) / self.granularity).astype(np.int64)
        return np.minimum(b, self.A - 1)

    def observe(self, b: int, now: float, cls: int) -> None:
        self.clock += 1
        self._since += 1
        if self._since >= self.reconfigure_every:
            self._reconfigure()
        self._prev_klass = int(self.klass[b])  # the class it held while resident (for the hit table)
        n = int(self.accesses[b]) + 1
        self.accesses[b] = n
        k = cls * N_STAGES + min(n, N_STAGES) - 1  # stage_class, inlined: the per-access path
        self.klass[b] = k
        self.klass_row[b] = k * self.A
        p = self.pred
        if p is not None and not ((b * 0x9E3779B1) >> 7) % p.sample_every:  # its sample, checked inline
            p.observe(b, now, cls)

    def on_hit(self, b: int, now: float, cls: int, next_use: int) -> None:
        age = self.clock - self.ts[b]
        self.hits[self._prev_klass, min(int(age / self.granularity), self.A - 1)] += 1
        self.ts[b] = self.clock

    def insert(self, b: int, now: float, cls: int, next_use: int) -> None:
        self.slots[self.size] = b
        self.where[b] = self.size
        self.size += 1
        self.ts[b] = self.clock

    def _densities(self, cand: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Current density (importance-weighted) and age bucket of resident blocks ``cand``."""
        buckets = ((self.clock - self.ts[cand]) * self._inv_g).astype(np.int64)
        np.minimum(buckets, self.A - 1, out=buckets)
        d = self._flat.take(self.klass_row[cand] + buckets)
        if self._weighted:
            d *= self.weight[cand]
        return d, buckets

    def _find_victim(self) -> tuple[int, int, float]:
        if self.size <= self.samples:  # a small cache: every resident is a candidate
            cand = self.slots[: self.size]
        else:  # random positions come from a pre-drawn pool: rng calls cost more than the lookup
            if self._pool_at + self.samples > self._pool.size:
                self._pool = self.rng.integers(0, self.capacity, size=self._pool.size)
                self._pool_at = 0
            r = self._pool[self._pool_at: self._pool_at + self.samples]
            self._pool_at += self.samples
            cand = self.slots[r if self.size == self.capacity else r % self.size]
        d, buckets = self._densities(cand)
        i = int(d.argmin())
        return int(cand[i]), int(buckets[i]), float(d[i])

    def admit(self, b: int, now: float, cls: int, next_use: int) -> bool:
        """Admit a missed block only if it is denser than the victim it would displace.

        One block in ``explore_every`` (by a hash of its id) is admitted anyway, so
        every class keeps producing evidence and a rejected class can recover."""
        if self.size < self.capacity:
            self._victim = -1
            return True
        v, bucket, vd = self._find_victim()
        self._victim, self._victim_bucket = v, bucket
        if not self.admission or (b * 0x9E3779B1) % self.explore_every == 0:
            return True
        if self.density[self.klass[b], 0] * self.weight[b] >= vd:
            return True
        self._victim = -1
        self.bypassed += 1
        return False

    def admit_many(self, blocks: np.ndarray, classes: np.ndarray) -> np.ndarray:
        """Vectorised ``admit`` for blocks offered from the tier above: a block is worth
        a slot if its density at age 0 (its feature class at its access stage) is at
        least the lowest of a fresh sample of residents, what the next eviction would
        take. Below ``samples`` residents everything is; one block in ``explore_every``
        always is. No state changes (no cached victim is left behind)."""
        ok = np.ones(blocks.size, dtype=bool)
        if not self.admission or self.size < self.samples or blocks.size == 0:
            return ok
        floor = float(self._densities(self.slots[self.rng.integers(0, self.size, size=self.samples)])[0].min())
        rows = stage_class(classes.astype(np.int64), self.accesses[blocks]) * self.A
        ok = self._flat.take(rows) * self.weight[blocks] >= floor
        ok |= (blocks * 0x9E3779B1) % self.explore_every == 0
        return ok

    def victims(self, n: int, eligible: Optional[Eligible] = None) -> np.ndarray:
        """The ``n`` lowest densities among ``samples`` x ``n`` residents sampled by a local
        generator (seeded by the clock: this policy's generator and pool are untouched),
        or among all residents when there are no more than that. No state changes."""
        if n <= 0 or self.size == 0:
            return np.zeros(0, dtype=np.int64)
        m = self.samples * n
        if self.size <= m:
            cand = self.slots[: self.size].copy()
        else:
            rng = np.random.default_rng((self.clock, self.size, n))
            cand = np.unique(self.slots[rng.integers(0, self.size, size=m)])
        if eligible is not None:
            cand = cand[np.asarray(eligible(cand), dtype=bool)]
        d, _ = self._densities(cand)
        return cand[np.argsort(d, kind="stable")[:n]]

    def on_evict(self, b: int, now: float) -> None:
        if self._victim == b:
            self._victim = -1
        self._record_eviction(b, int(self._bucket(self.clock - self.ts[b])))

    def on_freed(self, b: int) -> None:
        self.accesses[b] = 0
        self.klass[b] = 0
        self.klass_row[b] = 0
        self.ts[b] = 0
        self.weight[b] = 1.0
        if self.pred is not None:
            self.pred.on_freed(b)

    def seen(self, b: int) -> bool:
        return bool(self.accesses[b])

    def evict(self, now: float) -> int:
        if self._victim >= 0:
            v, bucket = self._victim, self._victim_bucket
        else:
            v, bucket, _ = self._find_victim()
        self._victim = -1
        self._record_eviction(v, bucket)
        return v

    def _record_eviction(self, v: int, bucket: int) -> None:
        """Eviction statistics of victim ``v`` (age bucket ``bucket``), then unlink it."""
        self.evictions[self.klass[v], bucket] += 1
        self._evict_age_sum += float(self.clock - self.ts[v])
        self._evict_n += 1
        p = self.pred
        if p is not None and p.accesses[v]:  # the predictor's horizon: this cache's eviction age, in epochs
            p.horizon += self.smoothing * (max(p.epoch - p.last[v], 1.0) - p.horizon)
        self._unlink(v)

    def best(self, k: int) -> np.ndarray:
        """Up to ``k`` of ``4k`` sampled residents with the highest density (for speculation)."""
        if self.size == 0 or k <= 0:
            return np.zeros(0, dtype=np.int64)
        cand = np.unique(self.slots[self.rng.integers(0, self.size, size=min(4 * k, 4 * self.size))])
        d, _ = self._densities(cand)
        return cand[np.argsort(-d, kind="stable")[:k]]

    def set_weights(self, blocks: np.ndarray, weights: np.ndarray) -> None:
        self.weight[blocks] = weights
        self._weighted = True

    def _unlink(self, b: int) -> None:
        i = int(self.where[b])
        last = int(self.slots[self.size - 1])
        self.slots[i] = last
        self.where[last] = i
        self.where[b] = -1
        self.size -= 1

    def remove(self, b: int) -> None:
        self._unlink(b)

    def _reconfigure(self) -> None:
        """Recompute densities from the decayed tables; re-coarsen ages to the eviction age."""
        self._since = 0
        hits, ev = self.hits, self.evictions
        events = hits + ev
        hits_above = np.cumsum(hits[:, ::-1], axis=1)[:, ::-1]
        events_above = np.cumsum(events[:, ::-1], axis=1)[:, ::-1]
        life_above = np.cumsum(events_above[:, ::-1], axis=1)[:, ::-1]
        with np.errstate(invalid="ignore", divide="ignore"):
            dens = np.where(life_above > 0, hits_above / life_above, 0.0)
        # cells with little evidence borrow the pooled density at their age: the victim is
        # the minimum over noisy estimates, and unshrunk sparse cells would win it too often
        pooled_h = hits_above.sum(0)
        pooled_l = life_above.sum(0)
        pooled = np.where(pooled_l > 0, pooled_h / np.maximum(pooled_l, 1e-12), 0.0)
        weight = events_above / (events_above + self.shrink_events)  # per cell: rare ages borrow too
        self.density = weight * dens + (1 - weight) * pooled[None, :]
        self._flat = self.density.reshape(-1)
        if self._evict_n:
            mean_age = self._evict_age_sum / self._evict_n
            new_g = max(1.0, 4.0 * mean_age / self.A)  # the mean eviction age sits at a quarter of the range
            if abs(new_g / self.granularity - 1) > 0.25:  # re-bucket the history when the scale moved
                ratio = self.granularity / new_g
                src = np.minimum((np.arange(self.A) * ratio).astype(np.int64), self.A - 1)
                self.hits = np.zeros_like(hits)
                self.evictions = np.zeros_like(ev)
                np.add.at(self.hits, (slice(None), src), hits)  # type: ignore[arg-type]  # numpy stubs omit tuple indices
                np.add.at(self.evictions, (slice(None), src), ev)  # type: ignore[arg-type]  # numpy stubs omit tuple indices
                self.granularity = new_g
                self._inv_g = 1.0 / new_g
        self.hits *= self.table_decay
        self.evictions *= self.table_decay
        self._evict_age_sum *= self.table_decay
        self._evict_n = self._evict_n * self.table_decay

    def stats(self) -> dict:
        out = {"granularity_accesses": self.granularity, "bypassed": self.bypassed}
        if self.pred is not None:
            out["horizon_epochs"] = self.pred.horizon
        return out


__all__ = ["HitDensityPolicy"]

