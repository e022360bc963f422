"""The metadata owner: block lifecycle and placement over three tiers.

``TierManager`` pairs a ``BlockTable`` with the pools, the NVMe store and the
mover. It is the only code that mutates metadata; it must be called from one
thread (the daemon's owner loop). Error conventions follow vLLM: ``None`` for
"does not fit", ``ValueError`` for caller misuse (raised before any state
changes), ``RuntimeError`` for a broken invariant. A failed transfer leaves
the block valid where it was and is reported in ``last_errors``.

Copy rules: a SEALED block is immutable, so copies in several tiers stay
valid and demoting a block that already has a lower copy costs no I/O. An
OPEN block has exactly one valid copy; moving it is a write-back.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import numpy as np
import torch

from kvtier.kernels.checksum import block_checksum

from .backoff import WriteBackoff
from .block_table import BlockTable
from .integrity import quarantine, read_nvme_verified, unindexed
from .intrusive import NIL
from .io_backends import IOBackend, select_backend
from .mover import Completion, Mover, Transfer
from .nvme import NvmeStore
from .pools import DramPool, HbmPool
from .slot_index import ENTRY, take_index, write_index
from .types import DRAM, FREE, HBM, NVME, OPEN, SEALED, Tier, TierError, parse_tier

EventListener = Callable[[str, int, int], None]  # (kind, block, tier)
FailureListener = Callable[[np.ndarray, int], None]  # (blocks a failed move left in tier, tier)
log = logging.getLogger("kvtier.tiers")


@dataclass
class _Pending:
    blocks: np.ndarray
    src: Tier
    dst: Tier
    keep_source: np.ndarray  # per block: keep the source copy
    chunks: int = 1
    progress: Optional[np.ndarray] = None  # parts landed (layer-wise DRAM -> HBM promotions)


class TierManager:
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
        if nvme_slots and not nvme_dir:
            raise ValueError("nvme_slots > 0 needs nvme_dir")
        self.block_bytes = int(block_bytes)
        self.clock = clock
        total = hbm_slots + dram_slots + nvme_slots
        self.table = BlockTable(max_blocks or max(1, total), (hbm_slots, dram_slots, nvme_slots))
        self.hbm = HbmPool(hbm_slots, block_bytes, device=hbm_device, tensor=hbm_tensor)
        self.dram = DramPool(dram_slots, block_bytes, numa_node=dram_numa_node)
        self.backend = select_backend(io_backend, io_threads) if isinstance(io_backend, str) else io_backend
        self.nvme = NvmeStore(nvme_dir, nvme_slots, block_bytes, self.backend) if nvme_slots and nvme_dir else None
        self.mover = Mover(self.hbm, self.dram, self.nvme, workers=mover_workers, queue_depth=queue_depth)
        self._tids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self.counters: Counter[str] = Counter()
        self.last_errors: dict[int, str] = {}
        self.listeners: list[EventListener] = []
        self.failure_listeners: list[FailureListener] = []  # e.g. placement: the victims are still resident
        self.nvme_backoff = WriteBackoff(nvme_backoff_s, max(30.0, nvme_backoff_s))
        self.corrupt = self.table.add_column("corrupt", np.bool_)  # reset when the entry is reused
        self.io_failures = self.table.add_column("io_failures", np.uint8)
        self.inflight = self.table.add_column("inflight_tid", np.int64)  # transfer moving the block (0: none)
        self.recovered = 0
        self.discarded = 0
        self.recovered_from = ""  # "index", "scan", or "" (nothing recovered)
        self._index_on_close = False  # only a manager that came up whole describes the tier
        if self.nvme is not None and recover:
            try:
                self._recover(recover_payloads)
            except BaseException:
                self.close()  # no leaked shared memory, threads or file handles
                raise
        elif self.nvme is not None:
            take_index(self.nvme)  # these slabs will be overwritten: an old index must not outlive them
        self._index_on_close = True

    # -- events ------------------------------------------------------------
    def _emit(self, kind: str, b: int, tier: int) -> None:
        for fn in self.listeners:
            fn(kind, b, tier)

    def _emit_many(self, kind: str, blocks: np.ndarray, tier: int) -> None:
        if self.listeners:
            for b in blocks.tolist():
                self._emit(kind, b, tier)

    # -- validation helpers ---------------------------------------------------
    def _check_block(self, b: int) -> int:
        b = int(b)
        if not self.table.is_valid_block(b):
            raise ValueError(f"unknown block {b}")
        return b

    def check_blocks(self, blocks: Iterable[int]) -> np.ndarray:
        arr = np.asarray(blocks if isinstance(blocks, np.ndarray) else list(blocks), dtype=np.int64).reshape(-1)
        t = self.table
        bad = (arr < 0) | (arr >= t.max_blocks)
        if not bad.any():
            bad = t.state[arr] == FREE
        if bad.any():
            raise ValueError(f"unknown block {int(arr[np.argmax(bad)])}")
        if arr.size > 1:
            srt = np.sort(arr)  # cheaper than np.unique on the acquire/release hot path
            if bool((srt[1:] == srt[:-1]).any()):
                raise ValueError("a block is named twice in one request")
        return arr

    # -- lifecycle ---------------------------------------------------------
    def alloc(self, n: int, full: bool = False) -> Optional[np.ndarray]:
        """n new OPEN blocks with HBM slots, all or nothing (None if no room).

        ``full``: the engine writes the slots directly, so all of each is payload."""
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
        t.refresh_evictable_many(out)
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

    def seal(self, b: int, key: int, nbytes: Optional[int] = None) -> int:
        """Seal an OPEN block under ``key``; returns the canonical block.

        If ``key`` is already sealed elsewhere (a shared prefix), this block is
        released and the existing one gains a reference. A corrupt block never
        absorbs a seal: these correct bytes take its key instead.
        """
        b = self._open_in_hbm(b, "is already sealed")
        t = self.table
        length = int(nbytes) if nbytes is not None else int(t.nbytes[b])
        if not 0 <= length <= self.block_bytes:
            raise ValueError(f"nbytes {length} out of range")
        existing = t.lookup(key)
        if existing >= 0 and self.corrupt[existing]:
            t.detach_key(existing)  # normally done at quarantine already
            existing = -1
        if existing >= 0:
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
        t.seal(b, key, block_checksum(data, length))
        self._emit("stored", b, Tier.HBM)
        return b

    def lookup(self, key: int) -> int:
        return self.table.lookup(key)

    def ref(self, key: int) -> int:
        """Take a reference on the sealed block with ``key`` (prefix hit)."""
        b = self.table.lookup(key)
        if b < 0:
            raise ValueError(f"unknown key {int(key):#x}")
        self.table.refcount[b] += 1
        return b

    def ref_many(self, blocks: np.ndarray) -> None:
        """One more reference on each of ``blocks`` (sealed prefix hits; a block may repeat)."""
        np.add.at(self.table.refcount, blocks, 1)

    def set_importance(self, blocks: np.ndarray, values: np.ndarray) -> None:
        """The scorer's importance of ``blocks``, kept beside the rest of their metadata."""
        self.table.importance[blocks] = values

    def drop_cached(self) -> int:
        """Drop every cached (unreferenced, unpinned, idle) block; returns how many."""
        t = self.table
        cached = np.flatnonzero((t.state != FREE) & (t.refcount == 0) & (t.pins == 0) & (t.busy == 0))
        for b in cached.tolist():
            self.drop(b)
        return int(cached.size)

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
        if t.refcount[b] == 0 and t.state[b] == OPEN and not t.busy[b] and not t.pins[b]:
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
        if not t.has_copy(b, HBM) or t.busy[b]:
            raise ValueError(f"block {b} is not resident in HBM")
        t.pins[b] += 1
        t.touch(b)
        t.refresh_evictable(b)
        return int(t.slot[HBM, b])

    def pin_many(self, blocks: np.ndarray, checked: bool = False) -> np.ndarray:
        """Vectorised ``pin``: all or nothing; returns the HBM slots.

        ``checked``: the caller already validated ids (live, no duplicates)."""
        t = self.table
        arr = blocks if checked else self.check_blocks(blocks)
        bad = ((t.copies[arr] >> HBM) & 1 == 0) | (t.busy[arr] != 0)
        if bad.any():
            raise ValueError(f"block {int(arr[np.argmax(bad)])} is not resident in HBM")
        t.pins[arr] += 1
        return t.slot[HBM, arr].astype(np.int64)

    def unpin_many(self, blocks: np.ndarray, checked: bool = False) -> None:
        t = self.table
        arr = blocks if checked else self.check_blocks(blocks)
        if np.any(t.pins[arr] <= 0):
            raise ValueError(f"block {int(arr[np.argmax(t.pins[arr] <= 0)])} is not pinned")
        t.pins[arr] -= 1
        self._reap(arr)

    def _reap(self, arr: np.ndarray) -> None:
        """Release OPEN blocks whose last reference went while they were pinned."""
        t = self.table
        dead = arr[(t.pins[arr] == 0) & (t.refcount[arr] == 0) & (t.state[arr] == OPEN) & (t.busy[arr] == 0)]
        for b in dead.tolist():
            self._emit("removed", b, -1)
            t.release_block(b)

    def unpin(self, b: int) -> None:
        b = self._check_block(b)
        t = self.table
        if t.pins[b] <= 0:
            raise ValueError(f"block {b} is not pinned")
        t.pins[b] -= 1
        t.refresh_evictable(b)
        self._reap(np.array([b]))

    # -- movement ----------------------------------------------------------
    def demote(self, blocks: Iterable[int], src: "Tier | int | str", dst: "Tier | int | str",
               keep_source: bool = False) -> Optional[int]:
        """Move (or copy) blocks to a lower tier. Returns a transfer id, 0 when
        no I/O was needed, or None when ``dst`` lacks free slots."""
        src, dst = parse_tier(src), parse_tier(dst)
        if dst <= src:
            raise ValueError(f"demote goes down: {src.name} -> {dst.name}")
        return self._move(self.check_blocks(blocks), src, dst, keep_source)

    def promote(self, blocks: Iterable[int], dst: "Tier | int | str" = Tier.HBM, chunks: int = 1) -> Optional[int]:
        """Copy blocks up into ``dst`` from their fastest lower copy.

        ``chunks`` > 1 (DRAM -> HBM): copy layer by layer and expose progress
        (``parts_ready``); ``block_bytes`` must divide evenly."""
        if chunks < 1 or self.block_bytes % chunks:
            raise ValueError(f"chunks={chunks} must divide block_bytes={self.block_bytes}")
        dst = parse_tier(dst)
        arr = self.check_blocks(blocks)
        copies = self.table.copies[arr].astype(np.int64)
        if np.any((copies >> dst) & 1):
            raise ValueError(f"block {int(arr[np.argmax((copies >> dst) & 1)])} is already in {dst.name}")
        lower = copies >> (dst + 1)
        if np.any(lower == 0):
            raise ValueError(f"block {int(arr[np.argmax(lower == 0)])} has no copy below {dst.name} to promote")
        src = dst + 1 + np.log2(lower & -lower).astype(np.int64)
        if np.any(src != src[0]):
            raise ValueError("promote: blocks come from different tiers; split the request")
        return self._move(arr, Tier(int(src[0])) if arr.size else dst, dst, keep_source=True, chunks=chunks)

    def _move(self, arr: np.ndarray, src: Tier, dst: Tier, keep_source: bool, chunks: int = 1) -> Optional[int]:
        t = self.table
        s, d = int(src), int(dst)
        if NVME in (s, d) and self.nvme is None:
            raise ValueError("no NVMe tier is configured")
        copies = t.copies[arr]
        problems = (
            ((copies >> s) & 1 == 0, f"has no valid copy in {src.name}"),
            (t.busy[arr] != 0, "is already moving"),
            ((t.pins[arr] != 0) & (not keep_source), "is pinned"),
        )
        for mask, why in problems:
            if np.any(mask):
                raise ValueError(f"block {int(arr[np.argmax(mask)])} {why}")
        sealed = t.state[arr] == SEALED
        keep = keep_source & sealed  # open blocks always move (one copy)
        need_io = (copies >> d) & 1 == 0
        io = arr[need_io]
        if t.free_slot_count(d) < io.size:
            return None
        clean = arr[~need_io & ~keep]  # dst copy already valid: just drop the source
        t.release_slots(clean, s)
        self._emit_many("removed", clean, s)
        self.counters[f"clean_{src.name.lower()}->{dst.name.lower()}"] += int((~need_io).sum())
        if io.size == 0:
            return 0
        dst_slots = t.assign_slots(io, d)
        assert dst_slots is not None
        tid = next(self._tids)
        layered = chunks > 1 and (s, d) == (DRAM, HBM)
        progress = np.zeros(1, dtype=np.int64) if layered else None
        xfer = Transfer(
            tid, src, dst, io.copy(), t.slot[s, io].astype(np.int64), dst_slots.astype(np.int64),
            t.key[io].copy(), t.nbytes[io].astype(np.int64), t.checksum[io].copy(), sealed[need_io].copy(),
            chunks if layered else 1, progress,
            self.nvme.reserve_seqs(io.size) if d == NVME and self.nvme is not None else None,
        )
        self.inflight[io] = tid
        t.busy[io] += 1
        t.refresh_evictable_many(io)
        self._pending[tid] = _Pending(io, src, dst, keep[need_io].copy(), chunks if layered else 1, progress)
        self.mover.submit(xfer)
        return tid

    def _apply(self, c: Completion) -> None:
        p = self._pending.pop(c.tid)
        t = self.table
        s, d = int(p.src), int(p.dst)
        path = f"{p.src.name.lower()}->{p.dst.name.lower()}"
        blocks = p.blocks
        t.busy[blocks] -= 1
        self.inflight[blocks] = 0
        good, bad = blocks[c.ok], blocks[~c.ok]
        t.copies[good] |= np.uint8(1 << d)
        self.io_failures[good] = 0  # failures count consecutive attempts only
        if c.checksums is not None:  # open blocks written back: checksum now known
            t.checksum[good] = c.checksums[c.ok]
        drop_src = good[~p.keep_source[c.ok]]
        t.release_slots(drop_src, s)
        self._emit_many("stored", good, d)
        self._emit_many("removed", drop_src, s)
        t.release_slots(bad, d)  # reserved, never valid: the source copy stays
        for b in bad.tolist():
            msg = c.errors.get(b, "transfer failed")
            self.last_errors[b] = msg
            self.io_failures[b] = min(255, int(self.io_failures[b]) + 1)
            if p.src == Tier.NVME and "failed its checksum" in msg:
                quarantine(self, b)
        self.counters[f"errors_{path}"] += int(bad.size)
        self.counters["nvme_read_retries"] += c.retried
        orphans = (t.refcount[blocks] == 0) & (t.state[blocks] == OPEN) & (t.busy[blocks] == 0)
        for b in blocks[orphans].tolist():
            self._emit("removed", b, -1)
            t.release_block(b)  # freed by its sequence while moving
        t.refresh_evictable_many(blocks[~orphans])
        if d == NVME:
            self._note_nvme_writes(int(good.size), int(bad.size))
        kept = bad[(t.state[bad] != FREE) & ((t.copies[bad] >> s) & 1 == 1)]
        if kept.size:
            for fn in self.failure_listeners:
                fn(kept, s)
        self.counters[f"moves_{path}"] += int(good.size)
        self.counters[f"bytes_{path}"] += c.nbytes
        self.counters[f"busy_ns_{path}"] += int(c.seconds * 1e9)

    def _note_nvme_writes(self, ok: int, failed: int) -> None:
        if failed:
            self.nvme_backoff.failed(self.clock())
            self.counters["nvme_write_backoffs"] += 1
        elif ok:
            self.nvme_backoff.succeeded()

    def nvme_writable(self) -> bool:
        """Is NVMe a destination now (configured, and not backing off after failed writes)?"""
        return self.nvme is not None and self.nvme_backoff.open(self.clock())

    def _quarantine(self, b: int) -> None:
        """A copy failed its checksum: never serve it (see ``integrity.quarantine``)."""
        quarantine(self, b)

    def parts_ready(self, blocks: np.ndarray, chunks: int) -> np.ndarray:
        """Per block: ``chunks`` if resident in HBM and idle, the parts already landed
        if a layer-wise promotion is moving it there, else 0."""
        t = self.table
        out = np.where(t.idle_in(blocks, HBM), chunks, 0).astype(np.int64)
        for i in np.flatnonzero(self.inflight[blocks]).tolist():
            p = self._pending.get(int(self.inflight[blocks[i]]))
            if p is not None and p.progress is not None and p.dst == Tier.HBM:
                out[i] = int(p.progress[0]) * chunks // p.chunks
        return out

    def has_pending(self) -> bool:
        """Are transfers submitted whose completions are not applied yet?"""
        return bool(self._pending)

    def pending_out(self, tier: "Tier | int") -> int:
        """Slots of ``tier`` that in-flight transfers will free when they complete."""
        return sum(int((~p.keep_source).sum()) for p in self._pending.values() if p.src == tier)

    def poll(self, timeout: Optional[float] = 0.0) -> list[Completion]:
        """Apply finished transfers; returns their completions."""
        done = self.mover.poll(timeout)
        for c in done:
            self._apply(c)
        return done

    def wait(self, timeout: Optional[float] = None) -> list[Completion]:
        """Block until every submitted transfer is applied."""
        out: list[Completion] = []
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if left == 0.0:
                raise TimeoutError(f"{len(self._pending)} transfers still pending")
            out.extend(self.poll(timeout=left if left is not None else 1.0))
        return out

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
        return read_nvme_verified(self, b, slot, length, verify=bool(t.state[b] == SEALED))

    # -- persistence ---------------------------------------------------------
    def _recover(self, verify_payload: bool) -> None:
        """Rebuild cached blocks from the NVMe tier: from the index a clean stop left
        (header mode), else by scanning every slot. The index is taken (and deleted)
        in both modes, so it never outlives this run."""
        assert self.nvme is not None
        index = take_index(self.nvme)
        if index is not None and not verify_payload:
            self.recovered_from = "index"
        else:
            found, self.discarded = self.nvme.recover(verify_payload=verify_payload)
            index = np.array([(r.slot, r.header.key, r.header.length, r.header.checksum) for r in found], dtype=ENTRY)
            self.recovered_from = "scan"
        if index.size > len(self.table.free_blocks):
            raise TierError(f"max_blocks is too small for the recovered NVMe contents ({index.size} blocks)")
        self.table.adopt_sealed(NVME, index["slot"], index["key"], index["length"], index["checksum"])
        self.recovered = int(index.size)

    def _nvme_index(self) -> np.ndarray:
        """Every sealed block with a good NVMe copy, as slot index entries."""
        t = self.table
        b = np.flatnonzero((t.state == SEALED) & ((t.copies >> NVME) & 1 == 1) & ~unindexed(self))
        out = np.empty(b.size, dtype=ENTRY)
        out["slot"], out["key"], out["length"], out["checksum"] = t.slot[NVME, b], t.key[b], t.nbytes[b], t.checksum[b]
        return out

    def tier_usage(self) -> list[dict]:
        """Slots and bytes per tier (for stats and metrics)."""
        t = self.table
        strides = (self.hbm.slot_stride, self.dram.slot_stride, self.nvme.data_stride if self.nvme else 0)
        return [{"tier": tier.name.lower(), "slots": t.slots_per_tier[tier], "used": t.used_slot_count(tier),
                 "capacity_bytes": t.slots_per_tier[tier] * strides[tier],
                 "used_bytes": t.used_slot_count(tier) * strides[tier]} for tier in Tier]

    def check_invariants(self) -> None:
        self.table.check_invariants()
        busy = np.flatnonzero(self.table.busy)
        pending = np.concatenate([p.blocks for p in self._pending.values()]) if self._pending else np.zeros(0, np.int64)
        if not np.array_equal(np.sort(busy), np.sort(pending)):
            raise RuntimeError("busy flags disagree with pending transfers")

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
