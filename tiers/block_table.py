"""Struct-of-arrays block metadata: the single source of truth for placement.

Block id = index into preallocated arrays (as in vLLM's block pool). Slots of each tier are owned
by at most one block; ``slot[t, b]`` and ``slot_owner[t][s]`` are kept as a bijection. Each tier
has an intrusive free list of slots. NVMe also has a list of the idle blocks holding a copy there,
in recency order: where the placement finds cached NVMe copies to drop (HBM and DRAM victims are
their policies' choice, ``kvtier.policy``). Nothing here moves bytes: the manager pairs this table
with pools and the mover. Only the owner thread may mutate a table; it is deliberately lock-free.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from .intrusive import NIL, IndexLists
from .key_index import KeyIndex, all_distinct
from .types import FREE, HBM, N_TIERS, NVME, OPEN, SEALED, Tier

GEN_MASK = 0xFFFFFFFF  # ``generation`` holds the free count mod 2^32


class BlockTable:
    def __init__(self, max_blocks: int, slots_per_tier: Sequence[int]) -> None:
        if len(slots_per_tier) != N_TIERS:
            raise ValueError(f"need {N_TIERS} slot counts, got {len(slots_per_tier)}")
        if max_blocks <= 0 or min(slots_per_tier) < 0:
            raise ValueError("max_blocks must be > 0 and slot counts >= 0")
        n = int(max_blocks)
        self.max_blocks = n
        self.slots_per_tier = tuple(int(s) for s in slots_per_tier)
        # -- per-block columns --
        self.key = np.zeros(n, dtype=np.uint64)
        self.state = np.zeros(n, dtype=np.uint8)
        self.refcount = np.zeros(n, dtype=np.int32)
        self.pins = np.zeros(n, dtype=np.int32)
        self.busy = np.zeros(n, dtype=np.uint8)  # transfers in flight, and the read holds below
        # remote writes reading the block's bytes (each also counted in ``busy``): every copy
        # stays where it is, but the block may gain copies and be pinned (see ``moving``)
        self.readers = np.zeros(n, dtype=np.uint8)
        self.copies = np.zeros(n, dtype=np.uint8)  # bit t: valid copy in tier t
        self.slot = np.full((N_TIERS, n), NIL, dtype=np.int32)
        self.nbytes = np.zeros(n, dtype=np.uint32)  # valid payload bytes
        self.checksum = np.zeros(n, dtype=np.uint64)  # of sealed bytes
        self.detached = np.zeros(n, dtype=np.bool_)  # sealed, but its key no longer maps to it (quarantined)
        # the count of frees (``releases``, mod 2^32) when the id was last freed: who holds a bare id
        # across owner-loop turns (an unfinished acquire, telemetry stamped with the count) tells
        # "the same block" from "another block that took the id" (``freed_since``)
        self.generation = np.zeros(n, dtype=np.uint32)
        self.releases = 0
        # -- policy columns (extension point: see ``add_column``) --
        self.importance = np.full(n, 0.5, dtype=np.float32)  # the scorer's neutral, until it says otherwise
        self.extra: dict[str, np.ndarray] = {}
        # -- indexes --
        self.keys = KeyIndex(n)
        self.free_blocks = IndexLists(n)
        self.free_blocks.extend_back(np.arange(n))
        self.nvme_idle = IndexLists(n)  # idle blocks with an NVMe copy, least recently used first
        self.slot_owner = [np.full(s, NIL, dtype=np.int32) for s in self.slots_per_tier]
        self.free_slots = [IndexLists(s) for s in self.slots_per_tier]
        for t, s in enumerate(self.slots_per_tier):
            self.free_slots[t].extend_back(np.arange(s))

    # -- extension -------------------------------------------------------
    def add_column(self, name: str, dtype: np.dtype | type, fill: float = 0) -> np.ndarray:
        """Register an extra per-block column (e.g. a policy's class id)."""
        if name in self.extra or hasattr(self, name):
            raise ValueError(f"column {name!r} exists")
        arr = np.full(self.max_blocks, fill, dtype=dtype)
        self.extra[name] = arr
        return arr

    # -- queries ---------------------------------------------------------
    def n_live_entries(self) -> int:
        return self.max_blocks - len(self.free_blocks)

    def free_slot_count(self, tier: int) -> int:
        return self.free_slots[tier].length()

    def used_slot_count(self, tier: int) -> int:
        return self.slots_per_tier[tier] - self.free_slots[tier].length()

    def has_copy(self, b: int, tier: int) -> bool:
        return bool(int(self.copies[b]) >> int(tier) & 1)

    def moving(self, blocks: np.ndarray) -> np.ndarray:
        """Per block: a transfer is moving it (a read hold alone is not: ``busy`` counts both)."""
        return self.busy[blocks] != self.readers[blocks]

    def read_hold(self, blocks: np.ndarray, delta: int) -> None:
        """Take (+1) or end (-1) a read hold on sealed blocks: it counts in ``busy`` (nothing evicts,
        drops, demotes or frees them), but is no move (they may be pinned and gain copies)."""
        if delta > 0 and (self.state[blocks] != SEALED).any():
            raise ValueError("only sealed blocks are read by a remote write")
        if delta < 0 and (self.readers[blocks] == 0).any():
            raise ValueError("unhold of a block that is not held")
        if delta > 0:
            self.busy[blocks] += 1
            self.readers[blocks] += 1
        else:
            self.busy[blocks] -= 1
            self.readers[blocks] -= 1
        self.refresh_nvme_idle_many(blocks)

    def idle_in(self, blocks: np.ndarray, tier: int) -> np.ndarray:
        """Per block: holds a valid copy in ``tier`` and no transfer is moving it."""
        return ((self.copies[blocks] >> tier) & 1 == 1) & ~self.moving(blocks)

    def idle_outside(self, blocks: np.ndarray, tier: int) -> np.ndarray:
        """Per block: no valid copy in ``tier`` and no transfer is moving it (a promotion candidate)."""
        return ((self.copies[blocks] >> tier) & 1 == 0) & ~self.moving(blocks)

    def home_tier(self, b: int) -> int:
        """Fastest tier holding a valid copy, or -1."""
        c = int(self.copies[b])
        return (c & -c).bit_length() - 1 if c else NIL

    def home_tiers(self) -> np.ndarray:
        """Vectorised home tier of every block (-1 where none)."""
        out = np.full(self.max_blocks, NIL, dtype=np.int8)
        for t in reversed(range(N_TIERS)):
            out[(self.copies >> t) & 1 == 1] = t
        return out

    def lookup(self, key: int) -> int:
        return self.keys.get(key)

    def is_valid_block(self, b: int) -> bool:
        return 0 <= b < self.max_blocks and self.state[b] != FREE

    # -- block lifecycle -------------------------------------------------
    def new_block(self) -> int:
        """Take an unused entry as an OPEN block with refcount 1; -1 if full."""
        b = self.free_blocks.pop_front()
        if b == NIL:
            return NIL
        self._init_entries(b)
        return b

    def _init_entries(self, b: "int | np.ndarray") -> None:
        """Fresh OPEN entries with refcount 1 (one id or an array of them)."""
        self.state[b] = OPEN
        self.refcount[b] = 1
        self.pins[b] = 0
        self.busy[b] = 0
        self.readers[b] = 0
        self.copies[b] = 0
        self.nbytes[b] = 0
        self.checksum[b] = 0
        self.key[b] = 0
        self.detached[b] = False
        self.importance[b] = 0.5
        for col in self.extra.values():
            col[b] = 0

    def adopt_sealed(self, tier: int, slots: np.ndarray, keys: np.ndarray, lengths: np.ndarray,
                     checksums: np.ndarray) -> np.ndarray:
        """New cached (refcount 0) SEALED blocks whose one valid copy already sits in
        ``slots`` of ``tier`` (a restart's NVMe contents), in one batch. All or
        nothing: too few entries, a taken slot or an indexed key changes nothing."""
        slots = np.asarray(slots, dtype=np.int64)
        n = slots.size
        keys = np.asarray(keys, dtype=np.uint64)
        if n > len(self.free_blocks):
            raise ValueError(f"{n} blocks to adopt, {len(self.free_blocks)} entries free")
        if n and ((self.slot_owner[tier][slots] != NIL).any() or not all_distinct(slots)):
            raise ValueError(f"a {Tier(tier).name} slot to adopt is taken or repeated")
        if not all_distinct(keys) or (n and (self.keys.get_many(keys) != NIL).any()):
            raise ValueError("a key to adopt is repeated or already indexed")
        blocks = self.free_blocks.pop_front_n(n)
        self._init_entries(blocks)
        self.state[blocks] = SEALED
        self.refcount[blocks] = 0
        self.key[blocks] = keys
        self.nbytes[blocks] = lengths
        self.checksum[blocks] = checksums
        self.free_slots[tier].remove_many(slots)
        self.slot_owner[tier][slots] = blocks
        self.slot[tier, blocks] = slots
        self.copies[blocks] = np.uint8(1 << tier)
        self.keys.insert_many(keys, blocks, checked=True)  # distinct and absent: checked above
        self.refresh_nvme_idle_many(blocks)
        return blocks

    def seal(self, b: int, key: int, checksum: int) -> None:
        self.seal_unindexed(b, key, checksum)
        self.detached[b] = False
        self.keys.insert(int(self.key[b]), b)

    def seal_unindexed(self, b: int, key: int, checksum: int) -> None:
        """Seal ``b`` under ``key`` without indexing it (the key is another namespace's, or
        its held block has other bytes and the engine keeps reading its own)."""
        self.key[b] = np.uint64(int(key) & ((1 << 64) - 1))
        self.checksum[b] = np.uint64(checksum)
        self.state[b] = SEALED
        self.detached[b] = True

    def detach_key(self, b: int) -> bool:
        """Unindex a sealed block's key but keep the block (its holders keep their
        reference): a lookup misses, and the next seal of the key makes a new block
        instead of folding into this one. Used for a block whose only copy is bad.
        False where there was nothing to detach (open, or detached already)."""
        if self.state[b] != SEALED or self.detached[b]:
            return False
        if self.keys.get(int(self.key[b])) == b:
            self.keys.pop(int(self.key[b]))
        self.detached[b] = True
        return True

    def release_block(self, b: int) -> None:
        """Return every slot and the entry itself; key is unindexed (if it is still ours)."""
        for t in range(N_TIERS):
            if self.slot[t, b] != NIL:
                self.release_slot(b, t)
        if self.state[b] == SEALED and not self.detached[b]:
            self.keys.pop(int(self.key[b]))
        self.detached[b] = False
        self.state[b] = FREE
        self.refcount[b] = 0
        self.pins[b] = 0
        self.busy[b] = 0
        self.readers[b] = 0
        self.releases += 1
        self.generation[b] = self.releases & GEN_MASK  # a waiter lives seconds, not 2^32 frees
        self.free_blocks.push_back(b)

    def freed_since(self, blocks: np.ndarray, g: int) -> np.ndarray:
        """Which ``blocks`` were freed since the free count was ``g`` (at most 2^31 ago): their ids
        may name other blocks now. One last freed 2^32 frees before can look so (odds (releases - g) / 2^32)."""
        since = (self.generation[blocks].astype(np.int64) - (g & GEN_MASK)) & GEN_MASK
        return (since >= 1) & (since <= self.releases - g)

    # -- slots -----------------------------------------------------------
    def assign_slot(self, b: int, tier: int) -> int:
        """Reserve a slot of ``tier`` for ``b`` (not yet valid); -1 if none."""
        if self.slot[tier, b] != NIL:
            raise ValueError(f"block {b} already holds a {Tier(tier).name} slot")
        s = self.free_slots[tier].pop_front()
        if s == NIL:
            return NIL
        self.slot_owner[tier][s] = b
        self.slot[tier, b] = s
        return s

    def claim_slot(self, b: int, tier: int, s: int) -> None:
        """Take a specific free slot (used by NVMe recovery)."""
        if self.slot_owner[tier][s] != NIL or self.slot[tier, b] != NIL:
            raise ValueError(f"slot {s} of {Tier(tier).name} or block {b} already taken")
        self.free_slots[tier].remove(s)
        self.slot_owner[tier][s] = b
        self.slot[tier, b] = s

    def mark_valid(self, b: int, tier: int) -> None:
        if self.slot[tier, b] == NIL:
            raise RuntimeError(f"block {b} has no {Tier(tier).name} slot to validate")
        self.copies[b] |= np.uint8(1 << tier)
        self.refresh_nvme_idle(b)

    def release_slot(self, b: int, tier: int) -> None:
        """Invalidate ``b``'s copy in ``tier`` and free the slot."""
        s = int(self.slot[tier, b])
        if s == NIL:
            raise ValueError(f"block {b} has no {Tier(tier).name} slot")
        self.copies[b] &= np.uint8(~(1 << tier) & 0xFF)
        if tier == NVME:
            self.nvme_idle.discard(b)
        self.slot_owner[tier][s] = NIL
        self.slot[tier, b] = NIL
        self.free_slots[tier].push_back(s)

    # -- the NVMe idle list ---------------------------------------------
    def refresh_nvme_idle(self, b: int) -> None:
        """``b`` on the NVMe idle list iff it has an NVMe copy and no transfer in flight. Pins do
        not matter: pin/unpin is the RPC hot path; the scan skips pinned blocks in O(1) instead."""
        want = bool(int(self.copies[b]) >> NVME & 1 and self.busy[b] == 0)
        lst = self.nvme_idle
        if want and not lst.contains(b):
            lst.push_back(b)
        elif not want and lst.contains(b):
            lst.remove(b)

    def refresh_nvme_idle_many(self, blocks: np.ndarray) -> None:
        """Batch form: vectorised membership test, O(1) fix per mismatch (added blocks are unlinked)."""
        blocks, lst = np.asarray(blocks, dtype=np.int64), self.nvme_idle
        on_nvme = (self.copies[blocks] >> NVME) & 1 == 1
        if not on_nvme.any():  # none can be listed (only blocks with an NVMe copy are): a DRAM move
            return
        want = (self.busy[blocks] == 0) & on_nvme
        have = lst.owner[blocks] == 0
        if not (want ^ have).any():  # the common case on a move: nothing to change
            return
        gone = ~want & have
        if gone.any():
            lst.remove_many(blocks[gone])
        want &= ~have
        if want.any():
            add = blocks[want]
            if not all_distinct(add):
                raise ValueError("refresh_nvme_idle_many: a block is named twice")
            lst.append_unlinked(add)

    def assign_slots(self, blocks: np.ndarray, tier: int) -> Optional[np.ndarray]:
        """Batch ``assign_slot``; None (and no change) if too few are free."""
        if (self.slot[tier, blocks] != NIL).any():
            raise ValueError(f"a block already holds a {Tier(tier).name} slot")
        if self.free_slots[tier].length() < blocks.size:
            return None
        slots = self.free_slots[tier].pop_front_n(blocks.size)
        self.slot_owner[tier][slots] = blocks
        self.slot[tier, blocks] = slots
        return slots

    def release_slots(self, blocks: np.ndarray, tier: int) -> None:
        """Batch ``release_slot`` of distinct blocks (a move's): vectorised bookkeeping, O(1)
        list ops each; their slots are distinct as they are (one owner a slot)."""
        if blocks.size == 0:
            return
        slots = self.slot[tier, blocks]
        if (slots == NIL).any():
            raise ValueError(f"a block has no {Tier(tier).name} slot")
        self.copies[blocks] &= np.uint8(~(1 << tier) & 0xFF)
        if tier == NVME:
            ev = self.nvme_idle
            ev.remove_many(blocks[ev.owner[blocks] == 0])
        self.slot_owner[tier][slots] = NIL
        self.slot[tier, blocks] = NIL
        self.free_slots[tier].extend_back(slots.astype(np.int64), distinct=True)

    def touch(self, b: int) -> None:
        """Record an access: the most recent end of the NVMe idle list (dropped last)."""
        lst = self.nvme_idle
        if lst.contains(b):
            lst.remove(b)
            lst.push_back(b)

    # -- invariants ------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise RuntimeError on any broken cross-structure invariant."""
        self.free_blocks.check()
        in_use = self.state != FREE
        free_ids = self.free_blocks.to_array()
        if np.any(in_use[free_ids]):
            raise RuntimeError("a block on the free list is in use")
        if free_ids.size + int(in_use.sum()) != self.max_blocks:
            raise RuntimeError("a FREE block is missing from the free list")
        if np.any(self.refcount < 0) or np.any(self.pins < 0):
            raise RuntimeError("negative refcount or pin count")
        if np.any(self.readers > self.busy) or np.any(self.readers[~in_use] != 0):
            raise RuntimeError("a read hold not counted in busy, or on a FREE block")
        if np.any(self.copies[~in_use] != 0):
            raise RuntimeError("a FREE block holds copies")
        if np.any((self.state == OPEN) & (self.refcount == 0) & (self.busy == 0)):
            raise RuntimeError("an OPEN block has refcount 0 (would be unreachable)")
        if np.any((self.pins != 0) & (self.slot[HBM] == NIL)):  # (a FREE block holds no slot)
            raise RuntimeError("a pinned block holds no HBM slot (a FREE one, or its engine's slot went to another)")
        for t in range(N_TIERS):
            self.free_slots[t].check()
            owner = self.slot_owner[t]
            held = np.flatnonzero(self.slot[t] != NIL)
            slots = self.slot[t, held]
            if not all_distinct(slots):
                raise RuntimeError(f"{Tier(t).name}: two blocks share a slot")
            if np.any(owner[slots] != held):
                raise RuntimeError(f"{Tier(t).name}: slot owner does not point back")
            owned = np.flatnonzero(owner != NIL)
            if owned.size != held.size:
                raise RuntimeError(f"{Tier(t).name}: slot ownership is not a bijection")
            free = self.free_slots[t].to_array()
            if np.any(owner[free] != NIL) or free.size + owned.size != self.slots_per_tier[t]:
                raise RuntimeError(f"{Tier(t).name}: free list and owners disagree")
            valid = (self.copies >> t) & 1 == 1
            if np.any(valid & (self.slot[t] == NIL)):
                raise RuntimeError(f"{Tier(t).name}: valid copy without a slot")
        self.nvme_idle.check()
        ev = np.zeros(self.max_blocks, dtype=bool)
        ev[self.nvme_idle.to_array()] = True
        want = ((self.copies >> NVME) & 1 == 1) & (self.busy == 0)
        if np.any(ev != want):
            bad = int(np.flatnonzero(ev != want)[0])
            raise RuntimeError(f"NVME: idle list membership wrong for block {bad}")
        sealed = np.flatnonzero((self.state == SEALED) & ~self.detached)
        if np.any(self.detached & (self.state != SEALED)):
            raise RuntimeError("a detached block is not sealed")
        if len(self.keys) != sealed.size:
            raise RuntimeError("key index size differs from the number of sealed blocks")
        if sealed.size and np.any(self.keys.get_many(self.key[sealed]) != sealed):
            raise RuntimeError("key index does not map a sealed key to its block")
        if np.any(in_use & (self.copies == 0) & (self.busy == 0) & (self.nbytes > 0)):
            raise RuntimeError("a block with data has no valid copy anywhere")

    def metadata_nbytes(self) -> int:
        cols: list[np.ndarray] = [
            self.key, self.state, self.refcount, self.pins, self.busy, self.readers, self.copies, self.detached,
            self.generation,
            self.slot, self.nbytes, self.checksum, self.importance,
            *self.extra.values(), *self.slot_owner,
        ]
        lists = [self.free_blocks, self.nvme_idle, *self.free_slots]
        return sum(c.nbytes for c in cols) + sum(x.nbytes() for x in lists) + self.keys.nbytes()
