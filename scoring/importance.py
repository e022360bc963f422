"""Attention importance per block: a score in [0, 1] for placement and prefetch order.

importance = max(structural prior, segment weight x EMA of reported attention
mass), where the mass a block receives is normalised within its sequence (the
block's share times the number of blocks, clipped to 1: a block with at least
its fair share of the attention scores 1). The structural priors are the
attention sinks (the first ``sink_blocks``: importance 1) and the recency window
(the newest ``recency_blocks``, read by every decode step: at least
``recency_floor``), by the block's place in the last report that named it (a
report is one sequence's blocks in order); the segment weight scales what the
attention says, not the priors. Pure numpy over the arrays it is handed: no
import from ``tiers`` or ``daemon``.

In exact mode importance only orders placement and prefetch; it never decides
what attention reads.
"""

from __future__ import annotations

from typing import Mapping, Optional

import numpy as np

NEUTRAL = 0.5  # the importance of a block no report has named

class ImportanceScores:
    def __init__(self, max_blocks: int, ema: float = 0.3, sink_blocks: int = 1, recency_blocks: int = 4,
                 recency_floor: float = 0.5, segment_weights: Optional[Mapping[str, float]] = None,
                 importance_floor: float = 0.2) -> None:
        if not 0 < ema <= 1:
            raise ValueError("ema must be in (0, 1]")
        self.ema_value = np.zeros(max_blocks, dtype=np.float32)
        self.reports = np.zeros(max_blocks, dtype=np.int32)
        self.segment = np.zeros(max_blocks, dtype=np.int16)  # index into segment_names
        self.prior = np.zeros(max_blocks, dtype=np.uint8)  # structural prior in 255ths (up), from the last report
        self.configure(ema, sink_blocks, recency_blocks, recency_floor, segment_weights, importance_floor)

    def configure(self, ema: float, sink_blocks: int, recency_blocks: int, recency_floor: float,
                  segment_weights: Optional[Mapping[str, float]], importance_floor: float) -> None:
        """Hot-reloadable knobs (config ``[scoring]``)."""
        self.ema = float(ema)
        self.sink_blocks = int(sink_blocks)
        self.recency_blocks = int(recency_blocks)
        self.recency_floor = float(recency_floor)
        self.importance_floor = float(importance_floor)
        names = ["", *sorted(segment_weights or {})]
        old = getattr(self, "segment_names", names)
        self.segment_names = names
        self.segment_weight = np.array([1.0] + [float((segment_weights or {})[n]) for n in names[1:]], np.float32)
        if old != names:  # keep tags meaningful across a reload that renames segments
            remap = np.array([names.index(n) if n in names else 0 for n in old], dtype=np.int16)
            self.segment[:] = remap[self.segment]

    def segment_id(self, tag: str) -> int:
        return self.segment_names.index(tag) if tag in self.segment_names else 0

    def tag(self, blocks: np.ndarray, tag: str) -> None:
        self.segment[blocks] = self.segment_id(tag)

    def report(self, blocks: np.ndarray, mass: np.ndarray, keep: Optional[np.ndarray] = None) -> None:
        """Fold one step's attention mass of one sequence's blocks, in order, into the EMA,
        and note each block's structural prior by its place in the sequence.

        ``mass`` is normalised here (share x number of blocks, clipped to 1),
        so engines may report raw sums of attention probabilities. ``keep``: the blocks
        to update (a mask); shares and places are still those of the whole report.
        """
        blocks = np.asarray(blocks, dtype=np.int64)
        mass = np.asarray(mass, dtype=np.float32)
        if blocks.shape != mass.shape or (keep is not None and np.shape(keep) != blocks.shape):
            raise ValueError("blocks, mass (and keep) must have the same length")
        if blocks.size == 0:
            return
        wide = mass.astype(np.float64)  # two float32 masses near 3e38 summed to inf in float32: every share 0
        total = float(wide.sum())
        share = wide / total * blocks.size if total > 0 else np.zeros_like(wide)
        x = np.clip(share, 0.0, 1.0)
        prior = self.structural_prior(np.arange(blocks.size), np.full(blocks.size, blocks.size))
        if keep is not None:
            blocks, x, prior = blocks[keep], x[keep], prior[keep]
        first = self.reports[blocks] == 0
        old = self.ema_value[blocks]
        self.ema_value[blocks] = np.where(first, x, old + self.ema * (x - old))
        self.reports[blocks] += 1
        self.prior[blocks] = np.ceil(prior * 255).astype(np.uint8)  # a floor stays a floor

    def structural_prior(self, position: np.ndarray, seq_len_blocks: Optional[np.ndarray] = None) -> np.ndarray:
        """1 for an attention sink, ``recency_floor`` in the recency window, else 0."""
        pos = np.asarray(position)
        prior = np.where(pos < self.sink_blocks, 1.0, 0.0)
        if seq_len_blocks is not None:
            recent = pos >= np.asarray(seq_len_blocks) - self.recency_blocks
            prior = np.maximum(prior, np.where(recent, self.recency_floor, 0.0))
        return prior

    def score(self, blocks: np.ndarray, position: Optional[np.ndarray] = None,
              seq_len_blocks: Optional[np.ndarray] = None) -> np.ndarray:
        """Importance in [0, 1] of ``blocks``; their places in their sequence when given,
        else those of the last report that named them."""
        blocks = np.asarray(blocks, dtype=np.int64)
        s = self.ema_value[blocks].astype(np.float64)
        s = np.where(self.reports[blocks] == 0, NEUTRAL, s)  # unknown: neutral
        s = s * self.segment_weight[self.segment[blocks]]
        if position is not None:
            prior = self.structural_prior(position, seq_len_blocks)
        else:
            prior = self.prior[blocks] / 255.0
        return np.clip(np.maximum(s, prior), 0.0, 1.0)

    def weight(self, blocks: np.ndarray) -> np.ndarray:
        """Multiplier of a block's value: floor + (1 - floor) x importance, over the same of a
        block nobody reported on (importance 0.5), so such a block weighs 1, as every block does
        in a policy before any report. Unscaled, a tagged or reported block of neutral importance
        weighed 0.6 against an unreported one's 1.0 and was evicted first."""
        floor = self.importance_floor
        return (floor + (1.0 - floor) * self.score(blocks)) / (floor + (1.0 - floor) * NEUTRAL)

    def forget(self, blocks: np.ndarray) -> None:
        self.ema_value[blocks] = 0
        self.reports[blocks] = 0
        self.segment[blocks] = 0
        self.prior[blocks] = 0


__all__ = ["ImportanceScores"]
