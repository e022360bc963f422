"""Per-engine bookkeeping: what each attached engine holds, so it can be reclaimed.

An engine's references (live blocks) and pins are counted per block; its
sequences map a sequence id to the blocks it allocated or referenced, so
``acquire``/``free`` can name a sequence instead of its blocks.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from .pin_counts import PinCounts


@dataclass
class EngineSession:
    engine_id: str
    pid: int
    block_tokens: int
    layout: dict
    last_seen: float
    max_blocks: int = 0
    pid_checkable: bool = True  # the pid names a process in the daemon's pid namespace
    ns: int = 0  # key namespace (``namespaces.Namespaces`` id)
    scope: int = 0  # what its keys are mixed with (``namespaces.key_scope``: stable across restarts)
    group: int = 0  # its name's namespaces (``Namespaces.group``), which a refs-only engine sees
    refs_only: bool = False  # looks keys up and refs them, never reads or writes bytes (a scheduler)
    block_bytes: int = 0  # this engine's block size (<= the daemon's slot payload; 0: the daemon's)
    pid_ns: int = 0  # the pid namespace its pid is in (with ``pid``: which process this is)
    tag: int = 0  # random per register; its telemetry names it, so an earlier session's is refused
    refs: Counter = field(default_factory=Counter)
    seqs: dict[int, list[int]] = field(default_factory=dict)
    pins: PinCounts = field(init=False)  # pins per block held by this engine (vectorised on the RPC path)

    def __post_init__(self) -> None:
        self.pins = PinCounts(self.max_blocks)

    def add_refs(self, blocks: np.ndarray, seq: "int | None") -> None:
        lst = blocks.tolist()
        self.refs.update(lst)
        if seq is not None:
            self.seqs.setdefault(seq, []).extend(lst)

    def continues(self, seq: "int | None", n: int) -> bool:
        """Do the last ``n`` blocks of ``seq`` continue a sequence that had blocks before them?"""
        return seq is not None and seq in self.seqs and len(self.seqs[seq]) > n

    def drop_ref(self, b: int) -> None:
        n = self.refs[b] - 1
        if n > 0:
            self.refs[b] = n
        else:
            del self.refs[b]

    def replace(self, old: int, new: int) -> None:
        """A sealed duplicate folded ``old`` into ``new`` (prefix sharing)."""
        self.drop_ref(old)
        self.refs[new] += 1
        for blocks in self.seqs.values():
            for i, b in enumerate(blocks):
                if b == old:
                    blocks[i] = new

    def seq_blocks(self, seqs: list[int]) -> np.ndarray:
        missing = [s for s in seqs if s not in self.seqs]
        if missing:
            raise ValueError(f"unknown sequence {missing[0]} for engine {self.engine_id!r}")
        out = [b for s in seqs for b in self.seqs[s]]
        return np.unique(np.asarray(out, dtype=np.int64)) if out else np.zeros(0, np.int64)

    def forget_blocks(self, blocks: set[int]) -> None:
        for s, lst in list(self.seqs.items()):
            keep = [b for b in lst if b not in blocks or self.refs.get(b, 0) > 0]
            if keep:
                self.seqs[s] = keep
            else:
                del self.seqs[s]


__all__ = ["EngineSession"]
