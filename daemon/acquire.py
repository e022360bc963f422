"""Acquire waiters and the prefetcher: bringing blocks into HBM on time.

An acquire pins every block that is already resident and starts promotions
for the rest; it completes when all are pinned, or fails at its deadline
(releasing what it pinned: nothing leaks). A hint queues blocks by deadline;
the prefetcher promotes them in idle time within a bandwidth budget, so a
later acquire finds them resident ("on time").
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from kvtier.tiers.integrity import MAX_READ_FAILURES
from kvtier.tiers.manager import TierManager
from kvtier.tiers.types import DRAM, HBM, Tier

from .placement import Placement
from .session import EngineSession


class Pending:
    """A request answered later, when its condition holds (the server routes the reply)."""

    reply_to: Any = None


@dataclass
class AllocWaiter(Pending):
    """An alloc that waits for demotions to free HBM slots instead of bouncing the engine."""

    session: EngineSession
    args: Any
    deadline: float
    reply_to: Any = None


@dataclass
class Waiter(Pending):
    ticket: int
    session: EngineSession
    blocks: np.ndarray
    deadline: float
    started: float
    blocking: bool
    generation: np.ndarray  # each block's ``BlockTable.generation`` when the acquire was made
    reply_to: Any = None  # opaque to this module: the server's routing info
    pinned: np.ndarray = field(init=False)  # set by __post_init__
    slots: np.ndarray = field(init=False)  # set by __post_init__

    def __post_init__(self) -> None:
        self.pinned = np.zeros(self.blocks.size, dtype=bool)
        self.slots = np.full(self.blocks.size, -1, dtype=np.int64)

    def vanished(self, mgr: TierManager) -> "tuple[str, str] | None":
        """(code, message) if a block not pinned yet was freed while the acquire waited.
        A waiter holds bare ids, not references: a cached block may be dropped, or the engine
        may free it, and its id go to another block, another namespace's too. Pinning that
        one would serve its bytes as the block asked for."""
        todo = ~self.pinned
        gone = todo & (mgr.table.generation[self.blocks] != self.generation)
        if not gone.any():
            return None
        b = int(self.blocks[np.argmax(gone)])
        return "invalid", f"block {b} was freed while the acquire waited; look its key up again"

    @property
    def done(self) -> bool:
        return bool(self.pinned.all())


def source_tiers(copies: np.ndarray, above: int) -> np.ndarray:
    """Fastest tier strictly below ``above`` holding a copy (-1 if none)."""
    lower = copies.astype(np.int64) >> (above + 1)
    out = np.full(copies.shape, -1, dtype=np.int64)
    has = lower > 0
    out[has] = above + 1 + np.log2(lower[has] & -lower[has]).astype(np.int64)
    return out


def promote_missing(mgr: TierManager, placement: Placement, blocks: np.ndarray, budget: Optional[int] = None,
                    urgent: bool = True, chunks: int = 1) -> int:
    """Start promotions to HBM for ``blocks`` that are neither resident nor moving.

    Frees HBM room through the placement policy first. Returns the number of
    promotions started.
    """
    t = mgr.table
    idle = ~t.moving(blocks) & ~mgr.corrupt[blocks] & (mgr.io_failures[blocks] < MAX_READ_FAILURES)
    missing = blocks[idle & ((t.copies[blocks] >> HBM) & 1 == 0)]
    if budget is not None:
        missing = missing[:budget]
    if missing.size == 0:
        return 0
    placement.make_room(HBM, int(missing.size), urgent=urgent)
    # making room may have started moving one of ours further down (DRAM -> NVMe): skip it this turn
    missing = missing[t.idle_outside(missing, HBM)]
    free = t.free_slot_count(HBM)
    src = source_tiers(t.copies[missing], HBM)
    started = 0
    for tier in np.unique(src[src >= 0]).tolist():
        if free <= 0:
            break
        group = missing[src == tier][:free]
        if mgr.promote(group, HBM, chunks=chunks) is not None:
            started += group.size
            free -= group.size
    return started


def pin_landed(w: Waiter, mgr: TierManager) -> np.ndarray:
    """Pin the waiter's blocks that are resident in HBM now; returns those still missing.
    Run for every waiter as soon as completions land, before anything may make room: a
    landed block is not pinned yet, so another waiter's promotion could evict it and reuse
    its slot, which a layer-wise acquire has already been told to read."""
    todo = np.flatnonzero(~w.pinned)
    if todo.size == 0:
        return w.blocks[:0]
    blocks = w.blocks[todo]
    t = mgr.table
    same = t.generation[blocks] == w.generation[todo]  # a block freed meanwhile is never pinned ...
    ready = same & t.idle_in(blocks, HBM)  # ... but its siblings are, until the failure is handled
    if ready.any():
        idx = todo[ready]
        w.slots[idx] = mgr.pin_many(w.blocks[idx])
        w.pinned[idx] = True
        w.session.pins.add(w.blocks[idx])
    if not same.all():  # the caller fails it (``failure``) and unpins: promote nothing more
        return w.blocks[:0]
    return blocks[~ready]


def progress(w: Waiter, mgr: TierManager, placement: Placement, chunks: int = 1) -> None:
    """Pin what is resident, promote what is not (never blocks)."""
    missing = pin_landed(w, mgr)
    if missing.size:
        promote_missing(mgr, placement, missing, chunks=chunks)


def unservable(blocks: np.ndarray, mgr: TierManager) -> "tuple[str, str] | None":
    """(code, message) if a block can never be brought to HBM, else None."""
    bad = mgr.corrupt[blocks]
    if bad.any():
        b = int(blocks[np.argmax(bad)])
        return "corrupt", f"block {b}: its only copy failed its checksum ({mgr.last_errors.get(b, '')}); not served"
    failed = mgr.io_failures[blocks] >= MAX_READ_FAILURES
    failed &= (mgr.table.copies[blocks] & 1) == 0
    if failed.any():
        b = int(blocks[np.argmax(failed)])
        return "io_error", f"block {b}: {MAX_READ_FAILURES} reads failed, last: {mgr.last_errors.get(b, '')}"
    return None


def failure(w: Waiter, mgr: TierManager) -> "tuple[str, str] | None":
    """Why an unfinished acquire can never complete, or None."""
    return w.vanished(mgr) or unservable(w.blocks[~w.pinned], mgr)


def unpin_waiter(w: Waiter, mgr: TierManager) -> None:
    held = w.blocks[w.pinned]
    try:
        if held.size:
            mgr.unpin_many(held)
            w.session.pins.sub(held)
    finally:  # even on a broken invariant: a waiter that kept its marks would fail every tick again
        w.pinned[:] = False


class Prefetcher:
    """Hinted blocks by deadline, promoted within a bytes-per-second budget."""

    def __init__(self, budget_bytes_per_s: float, block_bytes: int, max_blocks: int) -> None:
        self.budget_bytes_per_s = float(budget_bytes_per_s)
        self.block_bytes = block_bytes
        # (deadline, order, blocks, their generations): a hinted id freed meanwhile is skipped,
        # not promoted as whatever block took the id
        self._heap: list[tuple[float, int, np.ndarray, np.ndarray]] = []
        self._seq = itertools.count()
        self._tokens = 0.0
        self._last: Optional[float] = None
        self.hinted = 0
        self.started = 0
        # speculative promotions are judged by what became of them: acquired while
        # still in HBM (used), or gone from HBM first (wasted: a copy for nothing)
        self.speculated = 0
        self.speculative_used = 0
        self.speculative_wasted = 0
        self._spec = np.zeros(max_blocks, dtype=np.uint8)  # 1: promotion started, 2: in HBM
        self._spec_live = 0  # blocks with a state above: the acquire path checks nothing when 0

    def mark_speculative(self, blocks: np.ndarray) -> None:
        fresh = blocks[self._spec[blocks] == 0]
        self._spec[fresh] = 1
        self._spec_live += int(fresh.size)
        self.speculated += int(blocks.size)

    def note_acquired(self, blocks: np.ndarray) -> None:
        """An acquire served these blocks: speculative ones in HBM were worth their copy."""
        if not self._spec_live:
            return
        used = blocks[self._spec[blocks] == 2]
        if used.size:
            self._spec[used] = 0
            self._spec_live -= int(used.size)
            self.speculative_used += int(used.size)

    def on_event(self, kind: str, b: int, tier: int) -> None:
        """Manager copy events: a speculative block landing in, or leaving, HBM."""
        state = self._spec[b]
        if not state:
            return
        if kind == "stored" and tier == HBM:
            self._spec[b] = 2
        elif kind == "removed" and tier in (HBM, -1):
            self._spec[b] = 0
            self._spec_live -= 1
            if state == 2:
                self.speculative_wasted += 1

    def on_events(self, kind: str, blocks: np.ndarray, tier: int) -> None:
        """``on_event`` for a move's blocks at once: only speculative ones are looked at."""
        if self._spec_live:
            for b in blocks[self._spec[blocks] != 0].tolist():
                self.on_event(kind, b, tier)

    def hint(self, blocks: np.ndarray, deadline: float, generations: np.ndarray) -> None:
        if blocks.size:
            heapq.heappush(self._heap, (deadline, next(self._seq), blocks, generations))
            self.hinted += int(blocks.size)

    def __len__(self) -> int:
        return len(self._heap)

    def refill(self, now: float) -> None:
        """Bank bandwidth budget for the time passed (at most 50 ms worth, and never less
        than one block: a budget under 20 blocks/s had capped the bank below a block, so
        no hinted block was ever promoted ahead of its deadline)."""
        if self._last is not None:
            burst = max(self.budget_bytes_per_s * 0.05, float(self.block_bytes))
            self._tokens = min(burst, self._tokens + (now - self._last) * self.budget_bytes_per_s)
        self._last = now

    def run(self, mgr: TierManager, placement: Placement, now: float) -> int:
        """Promote hinted blocks, earliest deadline first, as the budget allows."""
        self.refill(now)
        started = 0
        t = mgr.table
        while self._heap:
            deadline, _, blocks, gens = self._heap[0]
            # the same blocks as hinted, outside HBM, idle, and readable (a corrupt block or one
            # whose reads keep failing is never promoted: kept, it would hold the queue's head)
            keep = (t.generation[blocks] == gens) & ~mgr.corrupt[blocks] & \
                (mgr.io_failures[blocks] < MAX_READ_FAILURES)
            keep[keep] = t.idle_outside(blocks[keep], HBM)
            wanted, gens = blocks[keep], gens[keep]
            if wanted.size == 0:
                heapq.heappop(self._heap)
                continue
            allowed = int(self._tokens // self.block_bytes) if deadline > now else wanted.size
            n = promote_missing(mgr, placement, wanted, budget=allowed, urgent=False) if allowed > 0 else 0
            if n == 0 and deadline <= now:  # no room for a hint already due: its acquire promotes
                heapq.heappop(self._heap)
                continue
            if n == 0:
                break  # no budget or no room: retry on the next idle turn
            self._tokens = max(0.0, self._tokens - n * self.block_bytes)
            started += n
            heapq.heapreplace(self._heap, (deadline, next(self._seq), wanted, gens))  # re-filtered next turn
        self.started += started
        return started

    def speculate(self, mgr: TierManager, placement: Placement, high_watermark: float, now: float) -> int:
        """Fill idle HBM with the most valuable DRAM blocks (predicted reuse, no hint).

        Runs only when nothing is hinted and HBM sits below its high watermark: the
        slots would otherwise hold nothing, so a wrong guess costs only the copy, and
        the copy is bounded by the same bandwidth budget as hinted prefetch."""
        t = mgr.table
        dram = placement.policies.get(int(Tier.DRAM))
        slots = t.slots_per_tier[HBM]
        room = int(high_watermark * slots) - t.used_slot_count(HBM)
        if dram is None or room <= 0 or len(self):
            return 0
        self.refill(now)
        k = min(room, int(self._tokens // self.block_bytes), 64)
        if k <= 0:
            return 0
        cand = dram.best(2 * k)
        if cand.size == 0:
            return 0
        ok = t.idle_outside(cand, HBM) & t.idle_in(cand, DRAM) & ~mgr.corrupt[cand]
        cand = cand[ok][:k]
        if cand.size == 0 or mgr.promote(cand, Tier.HBM) is None:
            return 0
        self.mark_speculative(cand)  # its "stored" event comes at a later poll of the owner loop
        self._tokens -= cand.size * self.block_bytes
        return int(cand.size)


__all__ = ["Pending", "AllocWaiter", "Waiter", "pin_landed", "progress", "failure", "unpin_waiter",
           "promote_missing", "Prefetcher", "source_tiers"]
