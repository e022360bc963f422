"""LHD (Beckmann, Chen & Cidon, NSDI '18): evict the lowest hit density, as published.

Hit density of a block of class c at age a (accesses since its last access,
coarsened by a right shift) is the expected hits it will still get divided
by the expected slot-time it will still hold, both estimated from the
decayed histograms of hit and eviction ages of its class:
density(c, a) = sum_{x>=a} hits(c, x) / sum_{x>=a} sum_{y>=x} events(c, y).
Classes are the reference's 16 hit-age classes, roughly log2 of
MAX_AGE / (last hit age + the one before) (one application class here). The
victim is the lowest density among 32 residents sampled uniformly. Every
``reconfigure_every`` accesses the histograms are decayed (EWMA 0.9) and the
densities recomputed; at the 5th and 25th reconfiguration the age coarsening
is set from the number of cached blocks. Before the first reconfiguration
densities follow the reference's GDSF-like start, (c + 1) / (a + 1). The
reference code reconfigures every 2^20 accesses, sized for traces of 10^8
requests: on a trace of a few 10^5 block accesses it would never learn, so
the default here is 2^17 (``reconfigure_every``).

This is the plain algorithm, the reference for kvtier's own policy: no
feature classes, no admission, none of the reference simulator's warm-up
shortcuts (fewer samples early, "explorer" blocks, recently admitted blocks
always sampled).
"""

from __future__ import annotations

import numpy as np

from kvtier.policy import register_policy
from kvtier.policy.base import Policy, swap_remove, swap_remove_many

HIT_AGE_CLASSES = 16
MAX_AGE = 20000
EWMA_DECAY = 0.9
AGE_COARSENING_ERROR_TOLERANCE = 0.01


def hit_age_class(age: int) -> int:
    """Doublings of ``age`` before it reaches MAX_AGE (capped): short hit ages, high classes."""
    if age == 0:
        return HIT_AGE_CLASSES - 1
    log = 0
    while age < MAX_AGE and log < HIT_AGE_CLASSES - 1:
        age <<= 1
        log += 1
    return log


@register_policy("lhd")
class LHDPolicy(Policy):
    replay_only = True

    def __init__(self, capacity: int, max_blocks: int, associativity: int = 32,
                 reconfigure_every: int = 1 << 17, seed: int = 0, **_: object) -> None:
        super().__init__(capacity, max_blocks)
        self.assoc = int(associativity)
        self.reconfigure_every = int(reconfigure_every)
        self.rng = np.random.default_rng(seed)
        self.hits = np.zeros((HIT_AGE_CLASSES, MAX_AGE))
        self.evictions = np.zeros((HIT_AGE_CLASSES, MAX_AGE))
        c = np.arange(HIT_AGE_CLASSES, dtype=np.float64)[:, None]
        self.density = (c + 1) / (np.arange(MAX_AGE, dtype=np.float64)[None, :] + 1)
        self.shift = 10
        self.clock = 0
        self.reconfigs = 0
        self._next = self.reconfigure_every
        self._ewma_n = 0.0
        self._ewma_mass = 0.0
        self.ts = np.zeros(max_blocks, dtype=np.int64)
        self.last_hit_age = np.zeros(max_blocks, dtype=np.int64)
        self.last_last_hit_age = np.full(max_blocks, MAX_AGE, dtype=np.int64)
        self.klass = np.zeros(max_blocks, dtype=np.int64)
        self.slots = np.zeros(capacity, dtype=np.int64)  # dense resident list: O(1) sampling
        self.where = np.full(max_blocks, -1, dtype=np.int64)

    def _age(self, b: "int | np.ndarray") -> "int | np.ndarray":
        return np.minimum((self.clock - self.ts[b]) >> self.shift, MAX_AGE - 1)

    def observe(self, b: int, now: float, cls: int) -> None:
        self.clock += 1
        self._next -= 1
        if self._next == 0:
            self._reconfigure()
            self._next = self.reconfigure_every

    def on_hit(self, b: int, now: float, cls: int, next_use: int) -> None:
        age = int(self._age(b))
        self.hits[self.klass[b], age] += 1
        self.last_last_hit_age[b] = self.last_hit_age[b]
        self.last_hit_age[b] = age
        self.klass[b] = hit_age_class(int(self.last_hit_age[b] + self.last_last_hit_age[b]))
        self.ts[b] = self.clock

    def insert(self, b: int, now: float, cls: int, next_use: int) -> None:
        self.last_hit_age[b] = 0
        self.last_last_hit_age[b] = MAX_AGE
        self.klass[b] = hit_age_class(MAX_AGE)
        self.ts[b] = self.clock
        self.slots[self.size] = b
        self.where[b] = self.size
        self.size += 1

    def evict(self, now: float) -> int:
        cand = self.slots[self.rng.integers(0, self.size, size=self.assoc)]
        age = self._age(cand)
        d = self.density[self.klass[cand], age]
        d[age == MAX_AGE - 1] = -np.inf  # overflowed ages go first, as in the reference
        v = int(cand[int(np.argmin(d))])
        self.evictions[self.klass[v], int(self._age(v))] += 1
        self._unlink(v)
        return v

    def _unlink(self, b: int) -> None:
        self.size = swap_remove(self.slots, self.where, self.size, b)

    def remove(self, b: int) -> None:
        self._unlink(b)

    def remove_many(self, blocks: np.ndarray) -> None:
        self.size = swap_remove_many(self.slots, self.where, self.size, blocks)

    def _reconfigure(self) -> None:
        self.hits *= EWMA_DECAY
        self.evictions *= EWMA_DECAY
        self._adapt_age_coarsening()
        events = self.hits + self.evictions
        hits_above = np.cumsum(self.hits[:, ::-1], axis=1)[:, ::-1]
        events_above = np.cumsum(events[:, ::-1], axis=1)[:, ::-1]
        life = np.cumsum(events_above[:, ::-1], axis=1)[:, ::-1]
        with np.errstate(invalid="ignore", divide="ignore"):
            dens = np.where(events_above > 1e-5, hits_above / life, 0.0)
        self.density[:, : MAX_AGE - 1] = dens[:, : MAX_AGE - 1]
        self.reconfigs += 1

    def _adapt_age_coarsening(self) -> None:
        """Set the age shift so the cache's blocks span ~1% of MAX_AGE (5th and 25th time)."""
        self._ewma_n = self._ewma_n * EWMA_DECAY + self.size
        self._ewma_mass = self._ewma_mass * EWMA_DECAY + 1.0
        if self.reconfigs + 1 not in (5, 25):
            return
        optimal = (self._ewma_n / self._ewma_mass) / (AGE_COARSENING_ERROR_TOLERANCE * MAX_AGE)
        new = 1
        while (1 << new) < optimal:
            new += 1
        delta, self.shift = new - self.shift, new
        self._ewma_n *= 8
        self._ewma_mass *= 8
        for t in (self.hits, self.evictions):
            if delta < 0:  # stretch
                d = -delta
                t[:, -1] += t[:, MAX_AGE >> d: MAX_AGE - 1].sum(axis=1)
                src = np.arange(MAX_AGE - 1) >> d
                t[:, : MAX_AGE - 1] = t[:, src] / (1 << d)
            elif delta > 0:  # compress
                n = MAX_AGE >> delta
                t[:, :n] = t[:, : n << delta].reshape(HIT_AGE_CLASSES, n, 1 << delta).sum(axis=2)
                t[:, n: MAX_AGE - 1] = 0

    def stats(self) -> dict:
        return {"reconfigurations": self.reconfigs, "age_shift": self.shift}


__all__ = ["LHDPolicy"]
