"""Shadow caches: miniature simulations that pick, online, the model the cache ranks by.

Each candidate model gets a miniature cache over a spatial sample of block ids
(SHARDS-style: a block is in the sample iff a hash of its id falls below a
threshold, so a sampled block's every access is seen) with the capacity scaled
by the same rate. The miniatures run the same mechanism as the real cache
(sampled victims, value-based admission), each ranking by its own candidate;
the candidate whose miniature earns the most (decayed) hits is the one the real
cache uses. Nothing here is tuned per trace: the workload in front of the cache
chooses.

Cost: the sample is sized to ``target_blocks`` residents per miniature, so the
work per access falls as the cache grows. Residency is one bit per candidate
per block (``member``); victims are chosen by slot position, so no reverse
index is needed.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

_HASH = 0x9E3779B1
SWITCH_MARGIN = 0.002  # a challenger must earn 0.2% more decayed hits than the model in use


class ShadowCaches:
    def __init__(self, capacity: int, max_blocks: int, n_candidates: int, target_blocks: int = 128,
                 samples: int = 8, seed: int = 1) -> None:
        if not 1 <= n_candidates <= 8:
            raise ValueError("1-8 candidates (one residency bit each)")
        rate = min(1.0, target_blocks / max(1, capacity))
        self.threshold = int(rate * (1 << 32))
        self.capacity = max(4, int(round(capacity * rate)))
        self.k = n_candidates
        self.samples = int(samples)
        self.slots = np.zeros((n_candidates, self.capacity), dtype=np.int64)
        self.size = [0] * n_candidates
        self.member = np.zeros(max_blocks, dtype=np.uint8)
        self.hits = np.zeros(n_candidates)
        self.rng = np.random.default_rng(seed)
        self._pool = self.rng.integers(0, self.capacity, size=4096 * self.samples)
        self._at = 0
        self._ks: dict[tuple[int, ...], np.ndarray] = {}  # the candidates that must evict, as an index array
        self._rows = np.arange(n_candidates)

    def sampled(self, b: int) -> bool:
        return (b * _HASH) & 0xFFFFFFFF < self.threshold

    def access(self, b: int, values_rows: Callable[[np.ndarray, np.ndarray], np.ndarray],
               values_new: Callable[[np.ndarray, int], np.ndarray]) -> None:
        """A sampled block ``b`` was accessed (after the model recorded it). Every
        candidate that must evict for it draws its sample, then all are valued in one
        gather (``values_rows``: candidates x sampled blocks). The per-access path of
        replay's hottest loop: a handful of numpy calls, whatever the number of candidates."""
        bits = int(self.member[b])
        full: list[int] = []
        size, cap = self.size, self.capacity
        for k in range(self.k):
            if bits >> k & 1:
                self.hits[k] += 1.0
            elif size[k] < cap:
                self.slots[k, size[k]] = b
                size[k] += 1
                bits |= 1 << k
            else:
                full.append(k)
        if full:
            key = tuple(full)
            ks = self._ks.get(key)
            if ks is None:
                ks = self._ks[key] = np.array(full)
            pos = self._draw(len(full))
            cand = self.slots[ks[:, None], pos]
            v = values_rows(ks, cand)
            i = v.argmin(axis=1)
            admitted = values_new(ks, b) > v[self._rows[: len(full)], i]  # else: not admitted
            if admitted.any():
                for r in np.flatnonzero(admitted).tolist():
                    k = full[r]
                    self.member[int(cand[r, i[r]])] &= ~np.uint8(1 << k)
                    self.slots[k, pos[r, i[r]]] = b
                    bits |= 1 << k
        self.member[b] = bits

    def _draw(self, n: int) -> np.ndarray:
        """``n`` rows of ``samples`` slot positions, in the order one row per candidate would
        take them (a fresh pool where the old one runs out)."""
        m = n * self.samples
        if self._at + m <= self._pool.size:
            pos = self._pool[self._at: self._at + m].reshape(n, self.samples)
            self._at += m
            return pos
        rows = []
        for _ in range(n):
            if self._at + self.samples > self._pool.size:
                self._pool = self.rng.integers(0, self.capacity, size=self._pool.size)
                self._at = 0
            rows.append(self._pool[self._at: self._at + self.samples])
            self._at += self.samples
        return np.stack(rows)

    def best(self, current: int) -> int:
        """The candidate with the most hits, if it beats ``current`` by more than
        ``SWITCH_MARGIN``; else ``current``. Candidates that tie (several good ones) would
        otherwise trade places on noise, and every switch re-ranks a cache that the
        previous model filled."""
        top = int(self.hits.argmax())
        return top if self.hits[top] > self.hits[current] * (1.0 + SWITCH_MARGIN) else current

    def decay(self, factor: float) -> None:
        self.hits *= factor

    def forget(self, b: int) -> None:
        """Block id ``b`` was freed: it leaves every miniature that holds it (its slot takes the
        miniature's last), so a recycled id starts unseen. A slot left naming it had been filled
        again when the id came back (the id held twice), and evicting one copy cleared the bit
        the other still stood for: that miniature then scored misses on a block it held."""
        bits = int(self.member[b])
        for k in range(self.k):
            if bits >> k & 1:
                n = self.size[k]
                at = int(np.flatnonzero(self.slots[k, :n] == b)[0])  # O(miniature), once per freed sampled id
                self.slots[k, at] = self.slots[k, n - 1]
                self.size[k] = n - 1
        self.member[b] = 0
