"""Per-engine bookkeeping: what each attached engine holds, so it can be reclaimed.

An engine's references (live blocks) and pins are counted per block, both in one
byte a block (``engine_counts``); its sequences map a sequence id to the blocks it
allocated or referenced, as int32 arrays (4 B an entry, no int object per block),
so ``acquire``/``free`` can name a sequence instead of its blocks.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import numpy as np

from .engine_counts import EngineCounts, PackedCounts


def _view(a: array) -> np.ndarray:
    """A sequence's blocks as a numpy view (writable; drop it before the array grows)."""
    return np.frombuffer(a, dtype=np.int32)


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
    seqs: dict[int, array] = field(default_factory=dict)  # sequence -> its blocks (int32, in order)
    loose: bool = False  # a block was freed by id while sequences listed blocks (``forget_blocks``)
    counts: EngineCounts = field(init=False, repr=False)
    refs: PackedCounts = field(init=False)  # references per block held by this engine
    pins: PackedCounts = field(init=False)  # pins per block held by this engine (vectorised on the RPC path)

    def __post_init__(self) -> None:
        self.counts = EngineCounts(self.max_blocks)
        self.refs, self.pins = self.counts.refs, self.counts.pins

    def add_refs(self, blocks: np.ndarray, seq: "int | None", unique: bool = False) -> None:
        """One reference per entry of ``blocks`` (``unique``: no id twice, as an alloc's),
        listed in ``seq`` if given."""
        if unique:
            self.refs.add(blocks)
        else:
            self.refs.add_many(blocks)
        if seq is not None:
            self.seqs.setdefault(seq, array("i")).frombytes(blocks.astype(np.int32).tobytes())

    def continues(self, seq: "int | None", n: int) -> bool:
        """Do the last ``n`` blocks of ``seq`` continue a sequence that had blocks before them?"""
        return seq is not None and seq in self.seqs and len(self.seqs[seq]) > n

    def fold(self, old: int, new: int) -> None:
        """A sealed duplicate folded ``old`` into ``new`` (prefix sharing): the reference moves.
        Its listing moves in ``relist``, once for a whole seal."""
        self.refs[old] = self.refs[old] - 1
        self.refs[new] = self.refs[new] + 1

    def relist(self, olds: np.ndarray, news: np.ndarray, seq: "int | None") -> None:
        """Sequences list ``news[i]`` where they listed ``olds[i]`` (open blocks ``fold`` moved).
        An open block is listed at most once, by the sequence it was allocated for (no lookup
        finds an open block), which is usually the seal's own ``seq``: found there, nowhere
        else is scanned."""
        order = np.argsort(olds)
        olds, news = olds[order], news[order]
        left = np.ones(olds.size, dtype=bool)
        if seq in self.seqs:
            v = _view(self.seqs[seq])
            at = np.isin(v, olds)
            i = np.searchsorted(olds, v[at])
            v[at] = news[i]
            left[i] = False
            del v
        if left.any():
            for s, hit in self._listing(olds[left]):
                v = _view(self.seqs[s])
                v[hit] = news[left][np.searchsorted(olds[left], v[hit])]

    def _listing(self, blocks: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """(sequence, mask of its entries in ``blocks``) for every sequence listing one, found
        in one numpy pass over all the engine's entries."""
        names = list(self.seqs)
        if not names or not blocks.size:
            return []
        lengths = np.fromiter((len(self.seqs[s]) for s in names), dtype=np.int64, count=len(names))
        hit = np.isin(np.concatenate([_view(self.seqs[s]) for s in names]), blocks)
        if not hit.any():
            return []
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
        touched = np.unique(np.searchsorted(starts, np.flatnonzero(hit), side="right") - 1)
        return [(names[i], hit[int(starts[i]): int(starts[i] + lengths[i])]) for i in touched.tolist()]

    def seq_blocks(self, seqs: list[int]) -> np.ndarray:
        """The unique blocks the named sequences list (sorted)."""
        return np.unique(self.seq_entries(seqs))

    def seq_entries(self, seqs: list[int]) -> np.ndarray:
        """Every entry of the named sequences, in order (a block twice if listed twice)."""
        missing = [s for s in seqs if s not in self.seqs]
        if missing:
            raise ValueError(f"unknown sequence {missing[0]} for engine {self.engine_id!r}")
        parts = [_view(self.seqs[s]) for s in seqs]
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

    def forget_blocks(self, blocks: np.ndarray) -> None:
        """Blocks of ``blocks`` this engine no longer references leave every sequence, and a
        sequence left empty goes.

        While no block was freed by id (``loose`` unset), no sequence lists a block more
        often than the engine references it: each listing took a reference, and a free by
        sequence drops listings with their references. A block no longer referenced is then
        listed nowhere, and there is nothing to scan. Otherwise every sequence's entries
        are checked in one numpy pass."""
        if self.loose and self.seqs and blocks.size:
            for s, hit in self._listing(blocks[self.refs[blocks] == 0]):
                keep = _view(self.seqs[s])[~hit]
                if keep.size:
                    self.seqs[s] = array("i", keep.tobytes())
                else:
                    del self.seqs[s]
        self.loose = self.loose and bool(self.seqs)


__all__ = ["EngineSession"]
