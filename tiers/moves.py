"""Tier state and block movement: the half of the tier manager that moves copies.

``TierMoves`` builds the block table, the pools, the NVMe store and the mover,
and owns every transfer in flight: demote and promote plan a ``Transfer``,
submit it without blocking, and apply its ``Completion`` on ``poll`` (copies,
slots, checksums, failures, the NVMe write backoff). ``TierManager`` adds the
block lifecycle on top; both run on the owner thread only.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from typing import Callable, ContextManager, Iterable, Optional

import numpy as np
import torch

from .backoff import WriteBackoff
from .block_table import BlockTable
from .integrity import count_read_failure, quarantine, unreachable_idle
from .io_backends import IOBackend, select_backend
from .key_index import all_distinct
from .landing import Pending, dropped, land, merged
from .listeners import BatchListener, EventListener, FailureListener, deferring, emit, emit_many
from .move_checks import PROMOTE_SOURCE, refuse_move
from .mover import Completion, Mover, Transfer
from .nvme import NvmeStore
from .planning import plan_common, unplan
from .pools import DramPool, HbmPool
from .types import DATA_PLANE_EVENTS, DRAM, FREE, HBM, NVME, ORPHAN_OWNER, SEALED, UNCLAIMED_NS, Tier, parse_tier

PATH_NAMES = {(int(a), int(b)): f"{a.name.lower()}->{b.name.lower()}" for a in Tier for b in Tier}  # counter keys
TID_WRAP = (1 << 31) - 1  # transfer ids cycle through 1 .. 2^31-1: 4 B a block, not 8


class TierMoves:
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
        self._tid_count = 0  # transfer ids handed out (``_next_tid``)
        self._pending: dict[int, Pending] = {}
        self._unapplied: deque[Completion] = deque()  # taken from the mover by a poll that raised
        self._deferred: Optional[list[BaseException]] = None  # listener errors while a group is applied
        # the data plane's events start at 0, so a scrape shows them (and rate() works) before the first
        self.counters: Counter[str] = Counter(dict.fromkeys(DATA_PLANE_EVENTS, 0))
        self.last_errors: dict[int, str] = {}
        self.listeners: list[EventListener] = []
        # a listener's vectorised twin, called once with a move's blocks (same effect as one call a
        # block: a 256 KiB copy's per-block calls had cost a third of the copy's time)
        self.batch_listeners: dict[EventListener, BatchListener] = {}
        self.failure_listeners: list[FailureListener] = []  # e.g. placement: the victims are still resident
        self.nvme_backoff = WriteBackoff(nvme_backoff_s, max(30.0, nvme_backoff_s))
        self.corrupt = self.table.add_column("corrupt", np.bool_)  # reset when the entry is reused
        self.io_failures = self.table.add_column("io_failures", np.uint8)
        self.inflight = self.table.add_column("inflight_tid", np.int32)  # transfer moving the block (0: none)
        self.namespace = self.table.add_column("namespace", np.uint16)  # whose block: set at alloc, never crossed
        self.hbm_slot_ns = np.zeros(hbm_slots, dtype=np.uint16)  # namespace whose bytes an HBM slot last held
        # namespace id -> its stable identity, written beside each NVMe copy so a restart gives
        # the block back to the namespace that sealed it (0: the library's default namespace)
        self.ns_owner = np.zeros(1 << 16, dtype=np.uint64)
        self.ns_owner[UNCLAIMED_NS] = ORPHAN_OWNER
        # blocks busy with I/O outside the mover (remote): (every held block, the read holds among them)
        self.held_elsewhere: list[Callable[[], tuple[np.ndarray, np.ndarray]]] = []

    # -- events ------------------------------------------------------------
    def _emit(self, kind: str, b: int, tier: int) -> None:
        emit(self.listeners, self._deferred, kind, b, tier)  # deferred while a group is applied (``_apply``)

    def _emit_many(self, kind: str, blocks: np.ndarray, tier: int) -> None:
        emit_many(self.listeners, self.batch_listeners, self._deferred, kind, blocks, tier)

    # -- validation helpers ---------------------------------------------------
    def _check_block(self, b: int) -> int:
        b = int(b)
        if not self.table.is_valid_block(b):
            raise ValueError(f"unknown block {b}")
        return b

    def check_blocks(self, blocks: Iterable[int]) -> np.ndarray:
        arr = np.asarray(blocks if isinstance(blocks, np.ndarray) else list(blocks), dtype=np.int64).reshape(-1)
        t = self.table
        if arr.size and (arr.min() < 0 or arr.max() >= t.max_blocks):
            bad = (arr < 0) | (arr >= t.max_blocks)
            raise ValueError(f"unknown block {int(arr[np.argmax(bad)])}")
        free = t.state[arr] == FREE
        if free.any():
            raise ValueError(f"unknown block {int(arr[np.argmax(free)])}")
        if not all_distinct(arr):  # (a sort, skipped where the blocks come in order)
            raise ValueError("a block is named twice in one request")
        return arr

    # -- movement ----------------------------------------------------------
    def demote(self, blocks: Iterable[int], src: "Tier | int | str", dst: "Tier | int | str",
               keep_source: bool = False) -> Optional[int]:
        """Move (or copy) blocks to a lower tier. Returns a transfer id, 0 when
        no I/O was needed, or None when ``dst`` lacks free slots."""
        src, dst = parse_tier(src), parse_tier(dst)
        if dst <= src:
            raise ValueError(f"demote goes down: {src.name} -> {dst.name}")
        tid = self._planned(blocks, src, dst, keep_source)
        return tid if tid is not None else self._move(self.check_blocks(blocks), src, dst, keep_source)

    def promote(self, blocks: Iterable[int], dst: "Tier | int | str" = Tier.HBM, chunks: int = 1) -> Optional[int]:
        """Copy blocks up into ``dst`` from their fastest lower copy.

        ``chunks`` > 1 (DRAM -> HBM): copy layer by layer and expose progress
        (``parts_ready``); ``block_bytes`` must divide evenly."""
        if chunks < 1 or self.block_bytes % chunks:
            raise ValueError(f"chunks={chunks} must divide block_bytes={self.block_bytes}")
        dst = parse_tier(dst)
        if chunks == 1 and dst == Tier.HBM:  # from DRAM: the common case, planned at once where it is
            tid = self._planned(blocks, Tier.DRAM, dst, True)
            if tid is not None:
                return tid
        arr = self.check_blocks(blocks)
        if arr.size == 0:
            return 0  # nothing to move, as ``demote`` answers
        src = PROMOTE_SOURCE[dst][self.table.copies[arr]]  # two lookups where bit arithmetic took ten passes
        first = int(src[0])
        if first < 0 or (src != first).any():
            copies = self.table.copies[arr]
            if ((copies >> dst) & 1).any():
                raise ValueError(f"block {int(arr[np.argmax((copies >> dst) & 1)])} is already in {dst.name}")
            if (src < 0).any():
                raise ValueError(f"block {int(arr[np.argmax(src < 0)])} has no copy below {dst.name} to promote")
            raise ValueError("promote: blocks come from different tiers; split the request")
        return self._move(arr, Tier(first), dst, keep_source=True, chunks=chunks)

    def _move(self, arr: np.ndarray, src: Tier, dst: Tier, keep_source: bool, chunks: int = 1) -> Optional[int]:
        """Plan, reserve and submit one transfer. Each numpy step here is a pass over the
        blocks on a core the copies already started want (~2-4 us each while memory is
        busy): the common case (idle blocks, none yet in ``dst``) skips the steps it needs not."""
        t = self.table
        s, d = int(src), int(dst)
        if NVME in (s, d) and self.nvme is None:
            raise ValueError("no NVMe tier is configured")
        copies = t.copies[arr]
        sealed = t.state[arr] == SEALED
        keep = keep_source & sealed  # open blocks always move (one copy)
        idle = not t.busy[arr].any()  # (no move and no read hold: a read hold counts in busy)
        pins = t.pins[arr]  # a pinned block may move only where its source copy stays (sealed, keep_source)
        if (copies & np.uint8(1 << s) == 0).any() or (pins.any() and (pins[~keep] != 0).any()) or not idle:
            refuse_move(t, arr, copies, keep, src)
        need_io = copies & np.uint8(1 << d) == 0
        every = bool(need_io.all())  # the common case: no copy in dst yet, nothing to drop
        io = arr if every else arr[need_io]
        if t.free_slot_count(d) < io.size:
            return None
        if not every:
            clean = arr[~need_io & ~keep]  # dst copy already valid: just drop the source
            t.release_slots(clean, s)
            self._emit_many("removed", clean, s)
            self.counters["clean_" + PATH_NAMES[s, d]] += int(arr.size - io.size)
        if io.size == 0:
            return 0
        dst_slots = t.assign_slots(io, d)
        assert dst_slots is not None
        tid = self._next_tid()
        # (an unindexed block's NVMe copy goes out as not sealed: a crash scan must not bring it back
        # over the indexed block of its key, another namespace's)
        layered = chunks > 1 and (s, d) == (DRAM, HBM)
        progress = np.zeros(1, dtype=np.int64) if layered else None
        io = io.copy() if every else io  # (``arr`` may be the caller's array; a gather is a copy already)
        disk = NVME in (s, d)  # only NVMe paths read the header fields
        xfer = Transfer(
            tid, src, dst, io, t.slot[s, io].astype(np.int64), dst_slots,
            t.key[io] if disk else None, t.nbytes[io].astype(np.int64), t.checksum[io] if disk else None,
            (sealed if every else sealed[need_io]) & ~t.detached[io] if disk else None,
            chunks if layered else 1, progress,
            self.nvme.reserve_seqs(io.size) if d == NVME and self.nvme is not None else None,
            self.ns_owner[self.namespace[io]] if d == NVME else None,
        )
        self._submit(xfer, marked=False)  # a host copy starts here: the bookkeeping below overlaps it
        self.inflight[io] = tid
        if idle and every:  # (no listener ran since ``idle`` was read)
            t.busy[io] = 1
        else:
            t.busy[io] += 1
        self._pending[tid] = Pending(io, src, dst, keep if every else keep[need_io], chunks if layered else 1, progress)
        if (copies & np.uint8(1 << NVME)).any():  # only blocks with an NVMe copy are on the idle list
            t.refresh_nvme_idle_many(io)  # overlaps the copy: only this thread reads the lists
        return tid

    def _next_tid(self, take: bool = True) -> int:
        """The next transfer id (int32 in the table; a pending tid never comes round again);
        ``take=False`` only reads it."""
        self._tid_count += take
        return (self._tid_count + (not take)) % TID_WRAP + 1

    def _planned(self, blocks: Iterable[int], src: Tier, dst: Tier, keep_source: bool) -> Optional[int]:
        """A memory move's common case, planned and submitted in one compiled pass
        (``planning``): its transfer id, or None where the numpy path must plan it."""
        tid = self._next_tid(take=False)
        got = plan_common(self.table, self.inflight, blocks, keep_source, int(src), int(dst), tid)
        if got is None:
            return None
        self._next_tid()
        src_slots, dst_slots, lengths, keep, nvme = got
        io = np.array(blocks, dtype=np.int64)  # (a copy: the caller's array may change)
        self._submit(Transfer(tid, src, dst, io, src_slots, dst_slots, None, lengths, None, None, 1, None, None,
                              None), marked=True)
        self._pending[tid] = Pending(io, src, dst, keep, 1, None)
        if nvme:  # only blocks with an NVMe copy are on the idle list
            self.table.refresh_nvme_idle_many(io)
        return tid

    def _submit(self, xfer: Transfer, marked: bool) -> None:
        """``mover.submit``; where it raises, nothing was submitted and the plan is undone
        (``unplan``: the slots taken go back, blocks ``marked`` moving are idle again)."""
        try:
            self.mover.submit(xfer)
        except BaseException:
            unplan(self.table, self.inflight, xfer.blocks, int(xfer.dst), marked)
            raise

    def _apply(self, group: list[Completion]) -> None:
        """Apply completions of one path as one (``_groups``), listener errors deferred."""
        with self.deferring_listeners():
            self._apply_completion(*merged([(self._pending.pop(c.tid), c) for c in group]))

    def deferring_listeners(self) -> ContextManager[None]:
        """Listener errors inside are raised once the bookkeeping is done (``listeners.deferring``)."""
        return deferring(self)

    def _groups(self, done: list[Completion]) -> list[list[Completion]]:
        """Consecutive memory-copy completions of one path (as one poll took them), applied
        in one pass: the mover copies descriptors queued back to back as one copy, and ~0.1 ms
        of numpy work a descriptor on the owner is wall time added to the move where copy
        threads fill every core. A group's events come per kind ("stored", then "removed")."""
        out: list[list[Completion]] = []
        key = None
        for c in done:
            p = self._pending.get(c.tid)  # (a stray tid fails in ``_apply``, in a group of its own)
            mine = ((c.src, c.dst) if p is not None and p.chunks == 1 and c.checksums is None
                    and NVME not in (c.src, c.dst) else None)
            if mine is not None and mine == key:
                out[-1].append(c)
            else:
                out.append([c])
            key = mine
        return out

    def _apply_completion(self, p: Pending, c: Completion) -> None:
        t = self.table
        s, d = int(p.src), int(p.dst)
        path = PATH_NAMES[s, d]
        blocks = p.blocks
        every = bool(c.ok.all())  # the common case: no mask to apply
        if every and c.checksums is None and NVME not in (s, d):  # a memory copy: every block landed
            good, bad = blocks, blocks[:0]
            drop_src = land(t, self.inflight, self.io_failures, self.hbm_slot_ns, self.namespace, blocks,
                            p.keep_source, s, d)
        else:
            t.busy[blocks] -= 1
            self.inflight[blocks] = 0
            good, bad = (blocks, blocks[:0]) if every else (blocks[c.ok], blocks[~c.ok])
            t.copies[good] |= np.uint8(1 << d)
            if d == HBM:  # failed ones too: a read that failed its checksum (or half-landed) left its
                # namespace's bytes in the slot, which an engine of another namespace must get zeroed
                self.hbm_slot_ns[t.slot[HBM, blocks]] = self.namespace[blocks]
            self.io_failures[good] = 0  # failures count consecutive reads only
            if c.checksums is not None:  # open blocks written back: checksum now known
                t.checksum[good] = c.checksums[c.ok]
            drop_src = dropped(good, p.keep_source if every else p.keep_source[c.ok])
            t.release_slots(drop_src, s)
        self._emit_many("stored", good, d)
        self._emit_many("removed", drop_src, s)
        t.release_slots(bad, d)  # reserved, never valid: the source copy stays
        for b in bad.tolist():
            msg = c.errors.get(b, "transfer failed")
            self.last_errors[b] = msg
            if d < s:  # a read: a failed write-back leaves a readable copy where it was
                count_read_failure(t, self.io_failures, self.counters, b)
            if p.src == Tier.NVME and "failed its checksum" in msg:
                self._quarantine(b)
        self.counters[f"errors_{path}"] += int(bad.size)
        self.counters["nvme_read_retries"] += c.retried
        orphans = unreachable_idle(t, self.corrupt, blocks)
        if orphans.any():
            for b in blocks[orphans].tolist():
                self._emit("removed", b, -1)
                t.release_block(b)  # freed by its sequence while moving
            t.refresh_nvme_idle_many(blocks[~orphans])
        else:
            t.refresh_nvme_idle_many(blocks)
        if d == NVME:
            self._note_nvme_writes(int(good.size), int(bad.size))
        self.counters[f"moves_{path}"] += int(good.size)
        self.counters[f"bytes_{path}"] += c.nbytes
        self.counters[f"busy_ns_{path}"] += int(c.seconds * 1e9)
        kept = bad[(t.state[bad] != FREE) & ((t.copies[bad] >> s) & 1 == 1)]
        if kept.size:
            for fn in self.failure_listeners:
                fn(kept, s)

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
        quarantine(self.table, self.corrupt, self.counters, self._emit, b)

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
        done = list(self._unapplied) + self.mover.poll(0.0 if self._unapplied else timeout)
        self._unapplied.clear()
        applied = 0
        for group in self._groups(done):
            applied += len(group)
            try:
                self._apply(group)
            except BaseException:
                self._unapplied.extend(done[applied:])  # taken from the mover: applied by the next poll
                raise
        return done

    def wait(self, timeout: Optional[float] = None) -> list[Completion]:
        """Block until every submitted transfer is applied. The mover finishes them all
        first and they are applied together (copies of one path in one pass): applying each
        as it landed woke this thread once a transfer, and on a host whose cores copy, each
        apply (~0.4 ms of numpy for 256 blocks) was taken from the copies still running."""
        out: list[Completion] = list(self.poll()) if self._unapplied else []
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if left == 0.0 or not self.mover.drain(timeout=left):
                raise TimeoutError(f"{len(self._pending)} transfers still pending")
            out.extend(self.poll())
        return out

    def check_invariants(self) -> None:
        self.table.check_invariants()
        outside = [fn() for fn in self.held_elsewhere]
        parts = [p.blocks for p in self._pending.values()] + [held for held, _ in outside]
        n = self.table.max_blocks
        count = lambda xs: np.bincount(np.concatenate(xs).astype(np.int64), minlength=n) if xs else np.zeros(n, np.int64)  # noqa: E731
        # a block may be both moving and read (a promotion during a remote write): count each
        if not np.array_equal(count(parts), self.table.busy):
            raise RuntimeError("busy counts disagree with pending transfers")
        if not np.array_equal(count([reading for _, reading in outside]), self.table.readers):
            raise RuntimeError("read holds disagree with the remote writes reading")


__all__ = ["TierMoves", "EventListener", "BatchListener", "FailureListener"]
