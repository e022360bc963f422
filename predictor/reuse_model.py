"""P(a block is reused within the next W accesses | its features, its age): a Beta-Bayesian model.

Evidence is read off the access stream, not off this cache's hits: every access
of a block records, for the cell the block was in at its previous access, the
distance (in accesses) since that access. So the evidence does not depend on
what the policy kept: no exploration quota, no self-fulfilling eviction, and
every candidate model (below) learns from the same counts.

Cells are feature class x access stage x last reuse distance
(``kvtier.predictor.cells``). Per cell ``c`` and distance bucket ``j`` (half
octaves of accesses): ``n[c, j]`` reuses and ``N[c]`` accesses; accesses not
yet reused are right-censored at their age (estimated from a sample of blocks
at each refresh), not counted as never reused. The hazard, P(reused in bucket
``j`` | not before it), is the reuses over the accesses at risk there (the
actuarial life table: one censored inside the bucket counts half), a Beta
posterior whose prior is its parent cell's hazard with ``prior_strength`` pseudo-observations
(hierarchical shrinkage: class x stage x distance -> class x stage -> stage -> all; past the
first stage, class x stage shrinks towards the class's previous stage, ``cells.ORDINAL``), so a
cell with little evidence answers with its parent's. Survival ``S(x)`` = P(next reuse distance
> ``x``) is log-linear inside a bucket (a constant hazard per access), and a block at age ``a`` is
reused within the next ``W`` accesses with probability ``1 - S(a + W) / S(a)``:
the window asked. Read at bucket edges, each end of the window had moved out to
the edge of the bucket it fell in, by up to 41% of its distance: many times
``W`` for an old block with a short horizon, and every probability read high.

A candidate model is a partition of the cells (which features it conditions on) and a horizon
multiple (W = multiple x this cache's mean eviction age: "reused before this cache would forget
it"); a density candidate ranks by P over the expected accesses the block holds its slot until
the reuse or W (hit density). Tables for all candidates are rebuilt every ``refresh_every``
accesses from the same counts; counts decay with a time constant of ``memory_horizons``
eviction ages, so the model's memory scales with the cache instead of being a constant chosen
on one trace. A reuse enters with the weight its access has in the counts by then (every
refresh's decay since the access, from a ring of the running total at each refresh): counted
whole, a reuse near ``tau`` weighed e^(d / tau) times its access, and hazards read high.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

try:  # the victim search in one call (kernels/_value.c); numpy otherwise, same decisions
    from kvtier.kernels._value import lowest as _c_lowest
except ImportError:  # pragma: no cover - exercised where the extension was not built
    _c_lowest = None

from kvtier.predictor.cells import (
    DEFAULT_CANDIDATES,
    N_CELLS,
    N_IRR,
    ORDINAL,
    PARENT,
    PARTITIONS,
    SUM_ROWS,
    Candidate,
    cell_of,
    first_cell_of,
    shrink_by_stage,
)
from kvtier.predictor.classes import MAX_COUNT, N_FEATURE_CLASSES
from kvtier.predictor.survival import (
    N_BUCKETS,
    distance_bucket,
    distinct_rows,
    hit_density,
    log_survival,
    log_survival_at,
    log_survival_slopes,
    window_probabilities,
)

PENDING_SAMPLE = 4096  # block ids sampled per refresh to estimate the not-yet-reused accesses
N_AGES = 256  # linear age buckets of the lookup tables ...
AGE_STEPS_PER_EVICTION_AGE = 8  # ... 1/8 of the eviction age wide: they cover 32 eviction ages
# Lookup tables are float32: they only rank and are read as probabilities; at 10^6 blocks
# the float64 tables of two caches' models cost 22 B a block of the 256 B metadata budget.
# Hazards and survival curves are float64; the window probabilities are computed in float32
# from them (within ~2e-5 of float64), the density in float64 and rounded once, when written.
TABLE_DTYPE = np.float32
DECAY_RING = 4096  # refreshes whose running decay total is kept (older accesses: the current rate)
DENSITY_CHUNK = 32  # age buckets per pass of the density computation: its float64 scratch stays small


class ReuseModel:
    """Per-block access state and the reuse-distance counts; owner of ``last``, ``count``, ``cell``."""

    def __init__(self, max_blocks: int, candidates: tuple[Candidate, ...] = DEFAULT_CANDIDATES,
                 prior_strength: float = 2.0, refresh_every: int = 2000, memory_horizons: float = 32.0,
                 initial_age: float = 1024.0) -> None:
        if not candidates:
            raise ValueError("at least one candidate model is required")
        for c in candidates:
            if c.partition not in PARTITIONS or c.horizon_multiple <= 0:
                raise ValueError(f"bad candidate {c}: partition in {sorted(PARTITIONS)}, horizon_multiple > 0")
        if not prior_strength > 0:  # (0: a cell with no evidence is 0/0, NaN)
            raise ValueError("prior_strength must be > 0")
        self.candidates = tuple(candidates)
        self.m = float(prior_strength)
        self.refresh_every = int(refresh_every)
        self.memory_horizons = float(memory_horizons)
        self.clock = 0
        self.refreshes = 0  # tables built from evidence so far (0: the initial recency ranking)
        self.last = np.zeros(max_blocks, dtype=np.int64)  # clock of the block's latest access
        self.count = np.zeros(max_blocks, dtype=np.uint8)  # accesses so far, saturating at MAX_COUNT
        self.cell = np.zeros(max_blocks, dtype=np.int16)  # class x stage x reuse distance at the latest access
        self.reuses = np.zeros((N_CELLS, N_BUCKETS))
        self.accesses = np.zeros(N_CELLS)
        # latest accesses of blocks freed before a reuse: never reused (the id is gone), so at
        # risk at every distance, not censored; weighed and decayed as ``accesses``
        self.freed = np.zeros(N_CELLS)
        self._known: Optional[tuple[np.ndarray, np.ndarray, np.ndarray]] = None  # ``preload``'s evidence
        self.eviction_age = float(initial_age)  # this cache's mean eviction age, in accesses
        self._ev_sum, self._ev_n = 0.0, 0.0
        self._log_decay = -self.refresh_every / (self.memory_horizons * self.eviction_age)  # the last refresh's
        self._decayed = 0.0  # log of the decay every count has taken so far
        # ring by refresh period (accesses at clocks (p r, (p + 1) r]): ``_decayed`` when
        # period p began, so an access's weight now is exp(_decayed - _period_start[p])
        self._period_start = np.zeros(DECAY_RING)
        self._rng = np.random.default_rng(0)
        # lookups use linear age buckets of a granularity that follows the eviction age (two
        # numpy ops per lookup); the counts keep log-spaced distances (scale-free evidence)
        self.granularity = max(1.0, self.eviction_age / AGE_STEPS_PER_EVICTION_AGE)
        self._inv_g = 1.0 / self.granularity
        # tables[k][cell, age bucket] = P(reused within W_k); before evidence: younger is better
        # one array for all candidates, so the shadow caches look every candidate up in one
        # gather; stored age-major ([k, age, cell]): a rebuild then copies whole rows of cells
        young_first = np.linspace(1.0, 0.0, N_AGES, dtype=TABLE_DTYPE)[:, None]
        self.table3 = np.tile(young_first, (len(self.candidates), 1, N_CELLS))
        self.tables = [t.T for t in self.table3]  # views indexed [cell, age]
        self.flat = [t.reshape(-1) for t in self.table3]  # flat index: age * N_CELLS + cell
        self.flat3 = self.table3.reshape(len(self.candidates), -1)
        self.horizons = np.ones(len(self.candidates))
        # density candidates rank by hit density; their P(reused within W) is kept beside it for
        # the calibration of the decisions they make
        self.prob = {k: np.zeros((N_AGES, N_CELLS), dtype=TABLE_DTYPE)
                     for k, c in enumerate(self.candidates) if c.density}
        # a refresh's scratch, written in place (fresh MBs each refresh fault in page by page:
        # that was most of its cost). One buffer, used in turn: as float64 by the density (3
        # rows of DENSITY_CHUNK ages), as float32 by the window step (all ages, all cells)
        density_scratch = 3 * DENSITY_CHUNK * N_CELLS if self.prob else 0
        self._scratch_bytes = np.zeros(max(8 * density_scratch, 4 * N_AGES * N_CELLS), dtype=np.uint8)
        self._scratch = self._scratch_bytes[: 8 * density_scratch].view(np.float64).reshape(3, -1)
        self._step = self._scratch_bytes[: 4 * N_AGES * N_CELLS].view(TABLE_DTYPE)
        # per partition its survival at each age (shared by its candidates), and a coarse
        # partition's window probabilities before they are expanded to the fine cells
        cells = {c.partition: int(PARTITIONS[c.partition].max()) + 1 for c in self.candidates}
        self._at_age = {name: np.zeros(N_AGES * n, dtype=TABLE_DTYPE) for name, n in cells.items()}
        self._coarse = np.zeros(N_AGES * max(cells.values()), dtype=TABLE_DTYPE)

    # -- evidence ----------------------------------------------------------
    def access(self, b: int, cls: int) -> bool:
        """One access of block ``b`` with feature class ``cls`` (the per-access path: scalar work only).
        True when the tables were rebuilt by this access. A block id or class out of range is
        refused before anything is recorded (numpy would wrap a negative index)."""
        if not 0 <= b < self.last.size or not 0 <= cls < N_FEATURE_CLASSES:
            raise IndexError(f"block {b} or feature class {cls} out of range ({self.last.size} blocks, "
                             f"{N_FEATURE_CLASSES} classes)")
        self.clock += 1
        st = int(self.count[b])
        irr = 0
        if st:
            d = self.clock - int(self.last[b])
            j = min(int(2.0 * math.log2(d)), N_BUCKETS - 1)
            # weighted as its access is weighted in ``accesses`` by now (forgetting by the age
            # of the access the evidence is about): at full weight, a reuse d accesses away was
            # counted e^(d/tau) times its access, and every hazard near tau read high
            r = self.refresh_every
            then, now = (self.clock - d - 1) // r, (self.clock - 1) // r  # refresh periods
            if then == now:
                weight = 1.0
            elif now - then < DECAY_RING:
                weight = math.exp(self._decayed - self._period_start[then % DECAY_RING])
            else:  # older than the ring: at the current rate (a weight near 0 by then)
                weight = math.exp((now - then) * self._log_decay)
            self.reuses[int(self.cell[b]), j] += weight
            irr = min(1 + j // 4, N_IRR - 1)
        st = min(st + 1, MAX_COUNT)
        self.count[b] = st
        cell = cell_of(cls, st, irr)
        self.cell[b] = cell
        self.accesses[cell] += 1.0
        self.last[b] = self.clock
        if self.clock % self.refresh_every == 0:  # on a fixed grid: the decay ring's periods
            self.refresh()
            return True
        return False

    def evicted(self, b: int) -> None:
        """The cache this model serves evicted ``b``: its age feeds the horizon."""
        self._ev_sum += float(self.clock - self.last[b])
        self._ev_n += 1.0

    def reset(self, b: int) -> None:
        """Block id ``b`` was freed: the next block with this id starts with no history. Its
        latest access, not reused, is never reused: it leaves the pending mass (no block
        carries it now) and stays at risk at every distance."""
        if self.count[b]:
            self.freed[int(self.cell[b])] += float(self._access_weights(self.last[b: b + 1])[0])
        self.count[b] = 0
        self.cell[b] = 0
        self.last[b] = 0

    # -- tables ------------------------------------------------------------
    def refresh(self) -> None:
        """Rebuild every candidate's table from the decayed counts (O(cells x buckets))."""
        self.refreshes += 1
        if self._ev_n >= 1.0:
            self.eviction_age = max(1.0, self._ev_sum / self._ev_n)
        self.granularity = max(1.0, self.eviction_age / AGE_STEPS_PER_EVICTION_AGE)
        self._inv_g = 1.0 / self.granularity
        tau = self.memory_horizons * self.eviction_age
        self._log_decay = -self.refresh_every / tau
        pending = self._pending()
        hazards: dict[str, np.ndarray] = {}
        # candidates of one partition share their survival curves and the survival at each age
        survival: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
        ages = np.arange(N_AGES) * self.granularity  # each lookup bucket's lower edge
        for k, cand in enumerate(self.candidates):
            w = max(1.0, cand.horizon_multiple * self.eviction_age)
            self.horizons[k] = w
            if cand.partition not in survival:
                # cells with the same hazards have the same tables: each distinct row is computed
                # once (most cells are empty or impossible, e.g. a first access with a reuse
                # distance, and answer with their parent's hazard: ~150 of 768 are distinct) and
                # expanded to the fine cells when written. Every step is per column, so the
                # tables are the ones computing every cell gives, bit for bit
                distinct, inverse = distinct_rows(self._hazard(cand.partition, pending, hazards))
                cmap = inverse[PARTITIONS[cand.partition]]
                log_surv_t = np.ascontiguousarray(log_survival(distinct).T)
                slopes = log_survival_slopes(log_surv_t).astype(TABLE_DTYPE)
                log_surv32 = log_surv_t.astype(TABLE_DTYPE)
                at_age = self._at_age[cand.partition][: N_AGES * distinct.shape[0]].reshape(N_AGES, -1)
                log_survival_at(log_surv32, slopes, ages + 1.0, out=at_age, step=self._step)
                survival[cand.partition] = log_surv_t, log_surv32, slopes, at_age, cmap
            log_surv_t, log_surv32, slopes, at_age, cmap = survival[cand.partition]
            table = self.prob[k] if cand.density else self.table3[k]
            p = self._coarse[: at_age.size].reshape(at_age.shape)  # distinct cells, then expanded
            window_probabilities(log_surv32, slopes, at_age, ages + 1.0 + w, out=p, step=self._step)
            np.take(p, cmap, axis=1, out=table, mode="clip")  # "raise" would buffer out: 5x slower
            if cand.density:
                # as many ages a pass as the scratch holds for this many distinct cells
                chunk = DENSITY_CHUNK * (N_CELLS // log_surv_t.shape[1])
                hit_density(log_surv_t, ages + 1.0, w, p, cmap, self.table3[k], self._scratch, chunk)
        decay = math.exp(self._log_decay)
        self.reuses *= decay
        self.accesses *= decay
        self.freed *= decay
        self._ev_sum *= decay
        self._ev_n *= decay
        self._decayed += self._log_decay
        if self.clock % self.refresh_every == 0:  # (a refresh called off the grid only decays)
            self._period_start[(self.clock // self.refresh_every) % DECAY_RING] = self._decayed

    def evidence(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """What a refresh reads now, in ``preload``'s terms: reuses per (cell, distance bucket),
        accesses per cell (a freed block's latest among them: neither reused nor pending, so at
        risk throughout) and the accesses pending per (cell, bucket of their age)."""
        return self.reuses.copy(), self.accesses.copy(), self._pending()

    def preload(self, reuses: np.ndarray, accesses: np.ndarray, censored: np.ndarray) -> None:
        """Evidence known before the first access (per cell: reuses per distance bucket,
        accesses, accesses censored per bucket), added to the counts at every refresh and
        never forgotten. Replay's hindsight reference (``kvtier-prefit``) only: an online
        cache has no such evidence."""
        shapes = ((N_CELLS, N_BUCKETS), (N_CELLS,), (N_CELLS, N_BUCKETS))
        if tuple(np.shape(a) for a in (reuses, accesses, censored)) != shapes:
            raise ValueError(f"preload: shapes {shapes} expected")
        self._known = (np.array(reuses, dtype=np.float64), np.array(accesses, dtype=np.float64),
                       np.array(censored, dtype=np.float64))

    @property
    def refresh_decay(self) -> float:
        """The weight the counts kept at the latest refresh (their forgetting per refresh period)."""
        return math.exp(self._log_decay)

    def _pending(self) -> np.ndarray:
        """Accesses not yet followed by a reuse, per (cell, bucket of their age so far):
        they are right-censored there, not evidence of no reuse.

        How many there are per cell is known exactly: every access is reused, is a live
        block's latest or was a freed block's latest (``freed``: never reused, so at risk
        throughout, not censored), so it is the cell's accesses less its reuses and its freed
        (all weighed alike).
        Only how they spread over ages is estimated, from a uniform sample of block ids, so
        a refresh costs O(sample), not O(blocks). Scaled from the sample alone, its noise
        left accesses at risk at distances none of them had reached (a cell of 1,000 whose
        sample read 900 kept 100 at risk at every longer distance, with no reuses there:
        its hazards read ~0, and a loop's next pass was predicted never to come). A cell
        the sample missed is censored at entry (its first bucket): no exposure is invented."""
        n = self.last.size
        ids = self._rng.integers(0, n, size=min(n, PENDING_SAMPLE)) if n > PENDING_SAMPLE else np.arange(n)
        ids = ids[self.count[ids] > 0]
        ages = self.clock - self.last[ids]
        weight = self._access_weights(self.last[ids])  # as in the counts
        flat = self.cell[ids].astype(np.int64) * N_BUCKETS + distance_bucket(ages + 1)
        rows = np.bincount(flat, weights=weight, minlength=N_CELLS * N_BUCKETS).astype(np.float64, copy=False)
        rows = rows.reshape(N_CELLS, N_BUCKETS)
        mass = np.maximum(self.accesses - self.reuses.sum(axis=1) - self.freed, 0.0)
        sampled = rows.sum(axis=1)
        rows *= np.divide(mass, sampled, out=np.zeros_like(mass), where=sampled > 0)[:, None]
        rows[:, 0] += np.where(sampled > 0, 0.0, mass)
        return rows

    def _access_weights(self, last: np.ndarray) -> np.ndarray:
        """The weight accesses made at clocks ``last`` have in the counts now (``access``'s rule)."""
        r = self.refresh_every
        then, now = (last - 1) // r, (self.clock - 1) // r
        log_w = np.where(now - then < DECAY_RING, self._decayed - self._period_start[then % DECAY_RING],
                         (now - then) * self._log_decay)
        log_w[then == now] = 0.0
        return np.exp(log_w)

    def _hazard(self, partition: str, pending: np.ndarray, memo: dict[str, np.ndarray]) -> np.ndarray:
        """Posterior mean hazard per (partition cell, distance bucket): reuses in the bucket
        over accesses still at risk there (the actuarial life table), each cell shrunk towards its
        parent's hazard with ``prior_strength`` pseudo-observations. Partition cells, not
        fine ones: a coarse candidate's tables are computed once per distinct cell (8x
        fewer for class x stage) and expanded to fine cells only when written."""
        if partition in memo:
            return memo[partition]
        cmap = PARTITIONS[partition]
        n_cells = int(cmap.max()) + 1
        agg = SUM_ROWS[partition]
        reuses, censored, total = self.reuses, pending, self.accesses
        if self._known is not None:
            reuses, total, censored = reuses + self._known[0], total + self._known[1], censored + self._known[2]
        reuses, censored, total = agg(reuses), agg(censored), agg(total)
        gone = np.cumsum(reuses + censored, axis=1)  # reused or censored at or before bucket j
        # at risk in bucket j: not yet reused or censored before it, less half of those censored
        # in it (the actuarial life table: a censored access was, on average, exposed to half
        # of its bucket; counted whole, the hazard of the bucket just ahead of the youngest
        # accesses read low, every reuse in it seen against accesses that had not got there)
        at_risk = np.maximum(total[:, None] - np.concatenate((np.zeros((n_cells, 1)), gone[:, :-1]), axis=1)
                             - 0.5 * censored, 0.0)
        parent = PARENT[partition]
        if parent is None:
            prior, strength = np.zeros((n_cells, N_BUCKETS)), 1.0
        else:
            to_parent = PARTITIONS[parent][first_cell_of(cmap, n_cells)]
            prior, strength = self._hazard(parent, pending, memo)[to_parent], self.m
        hazard = np.minimum((strength * prior + reuses) / (strength + at_risk), 1.0)
        if partition in ORDINAL:
            shrink_by_stage(hazard, reuses, at_risk, strength)
        memo[partition] = hazard
        return hazard

    def probability_table(self, k: int) -> np.ndarray:
        """Candidate ``k``'s P(reused within W) by [age, cell] (a density model's is kept apart)."""
        return self.prob.get(k, self.table3[k])

    def probability_just_accessed(self, k: int, b: int) -> float:
        return float(self.probability_table(k)[0, int(self.cell[b])])

    def probabilities(self, k: int, blocks: np.ndarray) -> np.ndarray:
        return self.probability_table(k).reshape(-1).take(self.table_index(blocks))

    # -- queries -------------------------------------------------------------
    def values(self, k: int, blocks: np.ndarray) -> np.ndarray:
        """Candidate ``k``'s P(reuse within its horizon) for ``blocks`` at their current age."""
        return self.flat[k].take(self.table_index(blocks))

    def table_index(self, blocks: np.ndarray) -> np.ndarray:
        """Flat [age, cell] index of ``blocks`` at their current age, into any table."""
        idx = self.age_buckets(blocks)
        idx *= N_CELLS
        idx += self.cell.take(blocks)
        return idx

    def lowest(self, k: int, blocks: np.ndarray, weight: Optional[np.ndarray] = None) -> tuple[int, float]:
        """(position in ``blocks``, value) of the lowest of candidate ``k``'s values,
        times ``weight[b]`` (float32) when given: the victim of a full cache's miss.
        One compiled call where ``kernels/_value.c`` was built, else numpy; the same
        numbers and the same first-lowest tie rule either way."""
        if _c_lowest is not None and blocks.dtype == np.int64 and blocks.flags.c_contiguous:
            return _c_lowest(blocks, self.flat[k], self.last, self.cell, self.clock, self._inv_g, N_AGES, N_CELLS,
                             weight)
        v = self.values(k, blocks)
        if weight is not None:
            v = v * weight[blocks]
        i = int(v.argmin())
        return i, float(v[i])

    def age_buckets(self, blocks: np.ndarray) -> np.ndarray:
        idx = ((self.clock - self.last.take(blocks)) * self._inv_g).astype(np.int64)
        np.minimum(idx, N_AGES - 1, out=idx)
        return idx

    def values_rows(self, ks: np.ndarray, blocks: np.ndarray) -> np.ndarray:
        """Row i: candidate ``ks[i]``'s values of ``blocks[i]`` (a 2-D array), in one gather."""
        return self.flat3[ks[:, None], self.table_index(blocks)]

    def values_just_accessed(self, ks: np.ndarray, b: int) -> np.ndarray:
        """Candidates ``ks``' values of block ``b`` at age 0."""
        return self.table3[ks, 0, int(self.cell[b])]

    def value_just_accessed(self, k: int, b: int) -> float:
        """Candidate ``k``'s value of block ``b`` at age 0, in the cell its latest access put it in."""
        return float(self.table3[k, 0, int(self.cell[b])])
