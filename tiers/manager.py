"""The metadata owner: block lifecycle and placement over three tiers.

``TierManager`` pairs a ``BlockTable`` with the pools, the NVMe store and the
mover (its bases: ``moves.TierMoves`` owns those and every transfer in flight,
``remote_blocks.RemoteBlocks`` adds the blocks a remote read fills or a remote write
reads; this class adds the block lifecycle and persistence). It is the only code that
mutates metadata; it must be called from one thread (the daemon's owner loop). Error conventions follow vLLM: ``None`` for
"does not fit", ``ValueError`` for caller misuse (raised before any state
changes), ``RuntimeError`` for a broken invariant. A failed transfer leaves
the block valid where it was and is reported in ``last_errors``.

Copy rules: a SEALED block is immutable, so copies in several tiers stay
valid and demoting a block that already has a lower copy costs no I/O. An
OPEN block has exactly one valid copy; moving it is a write-back.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import numpy as np
import torch

from kvtier.kernels.checksum import block_checksum

from .copy_tuning import CopyLoopChoice, choose_copy_loop, current_choice
from .integrity import read_nvme_verified, unindexed, unreachable_idle
from .intrusive import NIL
from .io_backends import IOBackend
from .ownership import Unclaimed
from .remote_blocks import RemoteBlocks
from .slot_index import recovered_entries, sealed_entries, take_index, write_index
from .types import HBM, NVME, OPEN, SEALED, UNCLAIMED_NS, Tier, TierError, parse_tier

log = logging.getLogger("kvtier.tiers")
CLEAR_DRAIN_S = 5.0  # how long a clear waits for transfers in flight (a healthy disk: milliseconds)


class TierManager(RemoteBlocks):
    def __init__(
        self,
        block_bytes: int,
        hbm_slots: int,
        dram_slots: int,
        nvme_slots: int,
        nvme_dir: Optional[str] = None,
        max_blocks: Optional[int] = None,
        io_backend: "str | IOBackend" = "auto",
        io_threads: int = 8,
        mover_workers: int = 2,
        queue_depth: int = 64,
        hbm_tensor: Optional[torch.Tensor] = None,
        hbm_device: Optional[str] = None,
        dram_numa_node: Optional[int] = None,
        recover: bool = True,
        recover_payloads: bool = True,
        clock: Callable[[], float] = time.monotonic,
        nvme_backoff_s: float = 1.0,
    ) -> None:
        super().__init__(block_bytes, hbm_slots, dram_slots, nvme_slots, nvme_dir=nvme_dir, max_blocks=max_blocks,
                         io_backend=io_backend, io_threads=io_threads, mover_workers=mover_workers,
                         queue_depth=queue_depth, hbm_tensor=hbm_tensor, hbm_device=hbm_device,
                         dram_numa_node=dram_numa_node, clock=clock, nvme_backoff_s=nvme_backoff_s)
        self.recovered = 0
        self.discarded = 0
        self.recovered_from = ""  # "index", "scan", or "" (nothing recovered)
        self.unclaimed = Unclaimed()  # recovered blocks of namespaces not registered yet
        self._index_on_close = False  # only a manager that came up whole describes the tier
        if self.nvme is not None and recover:
            try:
                self._recover(recover_payloads)
            except BaseException:
                self.close()  # no leaked shared memory, threads or file handles
                raise
        elif self.nvme is not None:
            take_index(self.nvme)  # these slabs will be overwritten (new headers outrank the old: seq_floor)
        self._index_on_close = True

    # -- lifecycle ---------------------------------------------------------
    def alloc(self, n: int, full: bool = False, ns: int = 0) -> Optional[np.ndarray]:
        """n new OPEN blocks with HBM slots, all or nothing (None if no room).

        ``full``: the engine writes the slots directly, so all of each is payload.
        ``ns``: the blocks' namespace; a slot that last held another namespace's
        bytes is zeroed first, so nobody reads what another tenant left there."""
        t = self.table
        if n < 0:
            raise ValueError("n must be >= 0")
        if t.free_slot_count(HBM) < n or len(t.free_blocks) < n:
            return None
        out = np.fromiter((t.new_block() for _ in range(n)), dtype=np.int64, count=n)
        t.assign_slots(out, HBM)
        t.copies[out] |= np.uint8(1 << HBM)
        if full:
            t.nbytes[out] = self.block_bytes
        self.namespace[out] = ns
        slots = t.slot[HBM, out]
        foreign = slots[self.hbm_slot_ns[slots] != ns]
        if foreign.size:
            self.hbm.zero(foreign)
            self.hbm_slot_ns[foreign] = ns
            self.counters["slots_zeroed"] += int(foreign.size)
        t.refresh_nvme_idle_many(out)
        return out

    def _open_in_hbm(self, b: int, sealed_why: str) -> int:
        """``b`` checked to be an OPEN block, resident in HBM and not moving (write, seal)."""
        b = self._check_block(b)
        t = self.table
        if t.state[b] != OPEN:
            raise ValueError(f"block {b} {sealed_why}")
        if not t.has_copy(b, HBM) or t.busy[b]:
            raise ValueError(f"block {b} must be resident in HBM and idle")
        return b

    def write(self, b: int, data: "bytes | np.ndarray", offset: int = 0) -> None:
        """Write payload bytes of an OPEN block resident in HBM."""
        b = self._open_in_hbm(b, "is sealed and immutable")
        t = self.table
        buf = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
        if offset < 0 or offset + buf.size > self.block_bytes:
            raise ValueError(f"write of {buf.size} bytes at {offset} overflows a {self.block_bytes}-byte block")
        slot = int(t.slot[HBM, b])
        if self.hbm.is_cuda:
            self.hbm.tensor[slot, offset: offset + buf.size].copy_(torch.from_numpy(buf.copy()))
        else:
            self.hbm.host_view(slot)[offset: offset + buf.size] = buf
        t.nbytes[b] = max(int(t.nbytes[b]), offset + buf.size)

    def seal(self, b: int, key: int, nbytes: Optional[int] = None, fold: bool = True) -> int:
        """Seal an OPEN block under ``key``; returns the canonical block.

        If ``key`` is already sealed elsewhere (a shared prefix), this block is
        released and the existing one gains a reference; with ``fold`` False (its bytes
        differ: ``same_bytes``) this one is sealed unindexed and kept instead. A
        corrupt block never absorbs a seal: these correct bytes take its key instead.
        """
        b = self._open_in_hbm(b, "is already sealed")
        t = self.table
        length = int(nbytes) if nbytes is not None else int(t.nbytes[b])
        if not 0 <= length <= self.block_bytes:
            raise ValueError(f"nbytes {length} out of range")
        existing = t.lookup(key)
        if existing >= 0 and (self.corrupt[existing] or self.namespace[existing] == UNCLAIMED_NS):
            # (corrupt: done at quarantine already; unclaimed: a live block takes a recovered one's key)
            t.detach_key(existing)
            existing = -1
        foreign = existing >= 0 and self.namespace[existing] != self.namespace[b]
        distinct = not fold and existing >= 0 and not foreign
        if existing >= 0 and not foreign and not distinct:
            if t.pins[b]:
                raise ValueError(f"block {b} is pinned; release it before folding it into shared block {existing}")
            t.refcount[existing] += t.refcount[b]
            self._emit("removed", b, -1)
            t.release_block(b)
            self.counters["seal_dedup"] += 1
            return existing
        slot = int(t.slot[HBM, b])
        data = self.hbm.slot_tensor(slot) if self.hbm.is_cuda else self.hbm.host_view(slot)
        t.nbytes[b] = length
        if foreign or distinct:  # scoped keys of two namespaces collided (2^-64), or the engine
            # keeps reading bytes of its own: sealed, but never shared
            t.seal_unindexed(b, key, block_checksum(data, length))
            self.counters["seal_kept_distinct"] += int(distinct)
        else:
            t.seal(b, key, block_checksum(data, length))
        self._emit("stored", b, Tier.HBM)
        return b

    def same_bytes(self, b: int, other: int, length: int) -> bool:
        """Would ``b``'s first ``length`` bytes seal with ``other``'s length and checksum?"""
        t = self.table
        if int(t.nbytes[other]) != length:
            return False
        slot = int(t.slot[HBM, b])
        data = self.hbm.slot_tensor(slot) if self.hbm.is_cuda else self.hbm.host_view(slot)
        return int(block_checksum(data, length)) == int(t.checksum[other])

    def lookup(self, key: int) -> int:
        return self.table.lookup(key)

    def ref(self, key: int) -> int:
        """Take a reference on the sealed block with ``key`` (prefix hit)."""
        if (b := self.table.lookup(key)) < 0:
            raise ValueError(f"unknown key {int(key):#x}")
        self.table.refcount[b] += 1
        return b

    def ref_many(self, blocks: np.ndarray) -> None:
        """One more reference on each of ``blocks`` (sealed prefix hits; a block may repeat)."""
        np.add.at(self.table.refcount, blocks, 1)

    def set_importance(self, blocks: np.ndarray, values: np.ndarray) -> None:
        """The scorer's importance of ``blocks``, kept beside the rest of their metadata."""
        self.table.importance[blocks] = values

    def drop_cached(self, drain_s: float = CLEAR_DRAIN_S, landed: Callable[[], None] = lambda: None) -> int:
        """Drop every cached (unreferenced, unpinned) block; how many (``kvtier clear``).

        Transfers in flight are applied first, for ``drain_s`` at most (else TimeoutError, and
        nothing is voided or dropped): a cached block being moved was skipped and still
        served after the clear, and an NVMe write queued before it packed its header under
        the new key, so the cleared entry came back after a crash. Then the NVMe headers are
        voided. A cached block a remote write is still reading loses its key now (no lookup
        finds it) and is released at its last ``unhold``. ``landed`` runs between the drain and
        the drop: the daemon pins there what just landed for the acquires waiting on it (a
        poll may already have reported its slot), as after every poll."""
        self.wait(timeout=drain_s)
        landed()
        if self.nvme is not None:
            self.nvme.void_headers()
        t = self.table
        cached = (t.state == SEALED) & (t.refcount == 0) & (t.pins == 0)  # (a remote read's placeholders: OPEN)
        for b in np.flatnonzero(cached & (t.busy != 0)).tolist():  # nothing moves now: held by a remote write
            t.detach_key(b)
        for b in np.flatnonzero(cached & (t.busy == 0)).tolist():
            self.drop(b)
        return int(np.count_nonzero(cached))

    def free(self, b: int, allow_pinned: bool = False) -> None:
        """Drop one reference. OPEN blocks die; SEALED ones become cached.

        ``allow_pinned``: the daemon drops one engine's reference to a block that
        another engine has pinned; the block then dies at its last unpin+free."""
        b = self._check_block(b)
        t = self.table
        if t.refcount[b] <= 0:
            raise ValueError(f"block {b} has no reference to free (double free?)")
        if t.pins[b] and not allow_pinned:
            raise ValueError(f"block {b} is pinned; release it before freeing")
        t.refcount[b] -= 1
        if unreachable_idle(t, self.corrupt, np.array([b]))[0]:
            self._emit("removed", b, -1)
            t.release_block(b)

    def drop(self, b: int) -> None:
        """Remove a cached (unreferenced, sealed, idle) block everywhere."""
        b = self._check_block(b)
        t = self.table
        if t.refcount[b] or t.pins[b] or t.busy[b]:
            raise ValueError(f"block {b} is live, pinned or moving; only cached blocks can be dropped")
        self._emit("removed", b, -1)
        t.release_block(b)

    def drop_copy(self, b: int, tier: "Tier | int | str") -> None:
        """Discard one copy of a sealed block that has another copy elsewhere."""
        b = self._check_block(b)
        tier = parse_tier(tier)
        t = self.table
        if not t.has_copy(b, tier):
            raise ValueError(f"block {b} has no copy in {tier.name}")
        if t.state[b] != SEALED or bin(int(t.copies[b])).count("1") < 2:
            raise ValueError(f"block {b}: its only copy cannot be dropped")
        if t.busy[b] or (tier == Tier.HBM and t.pins[b]):
            raise ValueError(f"block {b} is pinned or moving")
        t.release_slot(b, tier)
        self._emit("removed", b, tier)

    def pin(self, b: int) -> int:
        """Pin an HBM-resident block for a forward pass; returns its slot."""
        b = self._check_block(b)
        t = self.table
        if not t.has_copy(b, HBM) or t.busy[b] != t.readers[b]:
            raise ValueError(f"block {b} is not resident in HBM")
        t.pins[b] += 1
        t.touch(b)
        t.refresh_nvme_idle(b)
        return int(t.slot[HBM, b])

    def pin_many(self, blocks: np.ndarray, checked: bool = False) -> np.ndarray:
        """Vectorised ``pin``: all or nothing; returns the HBM slots.

        ``checked``: the caller already validated ids (live, no duplicates)."""
        t = self.table
        arr = blocks if checked else self.check_blocks(blocks)
        bad = ~t.idle_in(arr, HBM)  # a remote write reading it is no obstacle: it only reads
        if bad.any():
            raise ValueError(f"block {int(arr[np.argmax(bad)])} is not resident in HBM")
        t.pins[arr] += 1
        return t.slot[HBM, arr].astype(np.int64)

    def unpin_many(self, blocks: np.ndarray, checked: bool = False) -> None:
        t = self.table
        arr = blocks if checked else self.check_blocks(blocks)
        if (t.pins[arr] <= 0).any():
            raise ValueError(f"block {int(arr[np.argmax(t.pins[arr] <= 0)])} is not pinned")
        t.pins[arr] -= 1
        self._reap(arr)

    def unpin(self, b: int) -> None:
        b = self._check_block(b)
        t = self.table
        if t.pins[b] <= 0:
            raise ValueError(f"block {b} is not pinned")
        t.pins[b] -= 1
        t.refresh_nvme_idle(b)
        self._reap(np.array([b]))

    # -- reading (tests, CLI) ------------------------------------------------
    def read(self, b: int) -> bytes:
        """Valid payload bytes of ``b`` from its fastest copy (NVMe verified)."""
        b = self._check_block(b)
        t = self.table
        home = t.home_tier(b)
        if home == NIL:
            raise ValueError(f"block {b} has no valid copy")
        length = int(t.nbytes[b])
        slot = int(t.slot[home, b])
        if home == Tier.HBM:
            return self.hbm.read(slot)[:length]
        if home == Tier.DRAM:
            return self.dram.read(slot)[:length]
        assert self.nvme is not None  # home is NVMe
        # an open block's copy too: its write-back computed the checksum the table holds (an open
        # block has one copy, so the bytes on disk are the last ones written), and promote checks it
        return read_nvme_verified(self.nvme, self.counters, b, slot, length, int(t.checksum[b]))

    # -- persistence ---------------------------------------------------------
    def _recover(self, verify_payload: bool) -> None:
        """Rebuild cached blocks from the NVMe tier (``slot_index.recovered_entries``)."""
        assert self.nvme is not None
        index, self.recovered_from, self.discarded = recovered_entries(self.nvme, verify_payload)
        if index.size > len(self.table.free_blocks):
            raise TierError(f"max_blocks is too small for the recovered NVMe contents ({index.size} blocks)")
        blocks = self.table.adopt_sealed(NVME, index["slot"], index["key"], index["length"], index["checksum"])
        self.unclaimed.adopt(blocks, index["owner"], self.namespace)
        self.recovered = int(index.size)

    def claim(self, owner: int, ns: int) -> int:
        """Hand the recovered blocks of ``owner`` to namespace id ``ns`` (``ownership``); how many."""
        self.ns_owner[ns] = owner
        return self.unclaimed.claim(owner, ns, self.table, self.namespace)

    def _nvme_index(self) -> np.ndarray:
        """Every sealed block with a good NVMe copy, as slot index entries."""
        t = self.table
        b = np.flatnonzero((t.state == SEALED) & ((t.copies >> NVME) & 1 == 1) & ~unindexed(t, self.corrupt))
        return sealed_entries(t.slot[NVME, b], t.key[b], t.nbytes[b], t.checksum[b],
                              self.unclaimed.owners(b, self.namespace, self.ns_owner))

    def tier_usage(self) -> list[dict]:
        """Slots and bytes per tier (for stats and metrics)."""
        t = self.table
        strides = (self.hbm.slot_stride, self.dram.slot_stride, self.nvme.data_stride if self.nvme else 0)
        return [{"tier": tier.name.lower(), "slots": t.slots_per_tier[tier], "used": t.used_slot_count(tier),
                 "capacity_bytes": t.slots_per_tier[tier] * strides[tier],
                 "used_bytes": t.used_slot_count(tier) * strides[tier]} for tier in Tier]

    def tune_copy_loop(self, loop: str = "auto") -> CopyLoopChoice:
        """Set the loop host copies take (``copy_tuning``): ``auto`` times each on the DRAM pool,
        whose slots are scratch only while no block has a DRAM copy and nothing moves."""
        if self.table.used_slot_count(int(Tier.DRAM)) or self.has_pending():
            raise RuntimeError("tune_copy_loop: the DRAM pool holds blocks or transfers are in flight")
        return choose_copy_loop(self.mover.host_copier, self.dram.host_view_all(), loop)

    @property
    def copy_loop(self) -> CopyLoopChoice:
        """The loop host copies take now, and how it was chosen (process-wide: ``current_choice``)."""
        return current_choice()

    def close(self) -> None:
        self.mover.close()
        self.poll()
        if self.nvme is not None:
            if self._index_on_close:  # a clean stop: the next start need not scan
                self._index_on_close = False
                try:
                    self.nvme.sync()
                    write_index(self.nvme, self._nvme_index())
                except OSError as e:
                    log.warning("no slot index written (%s): the next start scans the slot headers", e)
            self.nvme.close()
        self.backend.shutdown()
        self.hbm.close()
        self.dram.close()


__all__ = ["TierManager"]
