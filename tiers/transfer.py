"""Transfer descriptors and their completions: what the owner submits and what comes back.

A ``Transfer`` is immutable (its arrays are read-only) so a worker thread can
read it while the owner goes on; a ``Completion`` carries a per-block success
mask and errors, applied by the owner when it polls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .types import Tier

HEADER_FIELDS = ("keys", "checksums", "sealed")  # a transfer to or from NVMe carries them


@dataclass(frozen=True)
class Transfer:
    """One batch of block copies from ``src`` to ``dst`` tier."""

    tid: int
    src: Tier
    dst: Tier
    blocks: np.ndarray
    src_slots: np.ndarray
    dst_slots: np.ndarray
    # each block's header fields, for NVMe paths (written beside the bytes, or checked against
    # them); None on a copy between memory tiers, which writes no header: gathering them cost
    # the owner five passes a descriptor of a move that never read them
    keys: Optional[np.ndarray]
    lengths: np.ndarray
    checksums: Optional[np.ndarray]
    sealed: Optional[np.ndarray]

    chunks: int = 1  # layer-wise: copy (and report) each block in this many equal parts, in order
    progress: Optional[np.ndarray] = None  # [1] int64: parts done for every block (DRAM -> HBM only)
    seqs: Optional[np.ndarray] = None  # NVMe writes: each block's write sequence, assigned by the owner
    owners: Optional[np.ndarray] = None  # NVMe writes: each block's namespace identity, for its header

    def __post_init__(self) -> None:
        n = self.blocks.size
        for name in ("src_slots", "dst_slots", "keys", "lengths", "checksums", "sealed"):
            arr = getattr(self, name)
            if arr is None:
                if name in HEADER_FIELDS and Tier.NVME not in (self.src, self.dst):
                    continue
                raise ValueError(f"Transfer.{name} is needed by a transfer to or from NVMe")
            if arr.size != n:
                raise ValueError(f"Transfer.{name} has {arr.size} entries, expected {n}")
            arr.setflags(write=False)
        self.blocks.setflags(write=False)

    def header(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(keys, checksums, sealed) of each block, which a transfer to or from NVMe carries."""
        if self.keys is None or self.checksums is None or self.sealed is None:
            raise ValueError("a transfer between memory tiers carries no header fields")
        return self.keys, self.checksums, self.sealed


@dataclass
class Completion:
    tid: int
    src: Tier
    dst: Tier
    blocks: np.ndarray
    ok: np.ndarray
    errors: dict[int, str] = field(default_factory=dict)  # block -> message
    nbytes: int = 0
    seconds: float = 0.0
    checksums: Optional[np.ndarray] = None  # set when the path computed them
    retried: int = 0  # NVMe reads of these blocks that failed once and were read again


__all__ = ["Transfer", "Completion"]
