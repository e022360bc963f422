"""Placement: wires registry policies to the tier manager's mechanism.

One policy object per upper tier (HBM, DRAM) ranks that tier's residents, the
same objects ``kvtier replay`` drives. Membership follows the manager's copy
events, so a policy always knows exactly the blocks holding a copy in its tier.
Accesses are logged at acquire time and applied to the policies later, in the
owner loop's idle time (``drain``), so an RPC reply never waits on policy
bookkeeping. The NVMe tier, the last one, drops cached blocks in LRU order of
the block table's eviction list; live blocks are never dropped. A victim whose
write-back failed is still resident: it goes back into its tier's policy, and
while the manager backs off a failing disk, NVMe is no destination (demotion
to DRAM and dropping cached blocks go on).

``make_room`` never blocks: it frees what it can now (clean drops are
immediate; write-backs are transfers) and the caller retries after the
transfers complete.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from kvtier.policy import make_policy
from kvtier.policy.base import Policy
from kvtier.predictor.classes import block_class
from kvtier.tiers.manager import TierManager
from kvtier.tiers.types import DRAM, FREE, HBM, NVME, SEALED, Tier

from .hint_deadlines import HintDeadlines

EPOCH_WRAP = (1 << 31) - 1  # logged epochs are compared for equality only: int32 suffices


class Placement:
    def __init__(self, mgr: TierManager, policy_name: str, params: dict, clock: Callable[[], float]) -> None:
        self.mgr = mgr
        self.clock = clock
        t = mgr.table
        n = t.max_blocks
        self.policies: dict[int, Policy] = {}
        for tier in (HBM, DRAM):
            if t.slots_per_tier[tier]:
                self.policies[tier] = make_policy(policy_name, t.slots_per_tier[tier], n, **params)
        self.tracked = np.zeros((2, n), dtype=bool)
        self.feature_class = np.zeros(n, dtype=np.int16)
        self._log = np.zeros(1 << 16, dtype=np.int64)
        # each logged access's block generation: an access of a block freed before the drain
        # must not be credited to the next block that takes its id
        self._log_gen = np.zeros(1 << 16, dtype=np.uint32)
        self._log_n = 0
        self.epoch_s = float(params.get("epoch_s", 1.0))
        self.logged_epoch = np.full(n, -1, dtype=np.int32)  # epoch mod 2^31: equality is all it is read for
        self.protect_until = HintDeadlines(n, clock())  # hinted blocks: not victims before their acquire is due
        self.dropped = 0
        self.demoted = 0
        self.declined = 0  # blocks a lower tier's policy did not find worth a slot
        mgr.listeners.append(self._on_event)
        mgr.batch_listeners[self._on_event] = self._on_events
        mgr.failure_listeners.append(self._on_failed_move)

    # -- membership ------------------------------------------------------------
    def _on_event(self, kind: str, b: int, tier: int) -> None:
        tiers = (HBM, DRAM) if tier < 0 else (tier,) if tier in self.policies else ()
        now = self.clock()
        for t in tiers:
            pol = self.policies.get(t)
            if pol is None:
                continue
            if kind == "stored" and not self.tracked[t, b]:
                cls = int(self.feature_class[b])
                if not pol.seen(b):  # e.g. recovered from NVMe: its access is still in the log
                    pol.observe(b, now, cls)
                pol.insert(b, now, cls, -1)
                self.tracked[t, b] = True
            elif kind == "removed" and self.tracked[t, b]:
                pol.remove(b)
                self.tracked[t, b] = False
        if kind == "removed" and tier < 0:  # the block is gone: its id may be reused
            for pol in self.policies.values():
                pol.on_freed(b)
            self.feature_class[b] = 0
            self.logged_epoch[b] = -1
            self.protect_until.clear(b)

    def _on_events(self, kind: str, blocks: np.ndarray, tier: int) -> None:
        """``_on_event`` for a move's blocks at once (the membership arrays in one step each)."""
        pol = self.policies.get(tier) if tier >= 0 else None
        if pol is None:
            if tier < 0:
                for b in blocks.tolist():
                    self._on_event(kind, b, tier)
            return
        tracked = self.tracked[tier, blocks]  # (a move's blocks are all new to dst, all tracked in src)
        if kind == "stored":
            new = blocks if not tracked.any() else blocks[~tracked]
            now = self.clock()
            classes = self.feature_class[new].astype(np.int64)
            unseen = ~pol.seen_many(new)  # e.g. recovered from NVMe: its access is still in the log
            if unseen.any():
                for b, cls in zip(new[unseen].tolist(), classes[unseen].tolist()):
                    pol.observe(b, now, cls)
            pol.insert_many(new, now, classes)
            self.tracked[tier, new] = True
        elif kind == "removed":
            gone = blocks if tracked.all() else blocks[tracked]
            pol.remove_many(gone)
            self.tracked[tier, gone] = False

    def _on_failed_move(self, blocks: np.ndarray, tier: int) -> None:
        """A move out of ``tier`` failed and left these blocks there: victims chosen
        for it left their policy, so they go back in and can be chosen again."""
        if tier in self.policies:
            self._reinsert(tier, blocks.tolist())

    def on_alloc(self, blocks: np.ndarray, continues: bool) -> None:
        """New open blocks land in HBM; their class comes from what the engine told us."""
        cls = block_class(True, continues, int(blocks.size))
        self.feature_class[blocks] = cls
        now = self.clock()
        for b in blocks.tolist():
            for pol in self.policies.values():  # its first access, seen by every policy as in replay
                pol.observe(b, now, cls)
            self._on_event("stored", b, HBM)

    def on_seal(self, blocks: "int | np.ndarray", continues: bool, span: int) -> None:
        """Sealed ``blocks`` (one id or an array) of a request with these features."""
        self.feature_class[blocks] = block_class(False, continues, span)

    # -- accesses (deferred) ---------------------------------------------------------
    def log_access(self, blocks: np.ndarray) -> None:
        self.protect_until.clear(blocks)  # a hint is fulfilled by the acquire it announced
        self._log_access(blocks)

    def _log_access(self, blocks: np.ndarray) -> None:
        """Queue accesses for the policies, once per block per epoch (the predictor's
        time unit): repeated acquires of a hot block within an epoch are one event."""
        epoch = int(self.clock() / self.epoch_s) % EPOCH_WRAP
        fresh = self.logged_epoch[blocks] != epoch
        if not fresh.any():
            return
        blocks = blocks[fresh]
        self.logged_epoch[blocks] = epoch
        n = blocks.size
        if self._log_n + n > self._log.size:
            size = max(self._log.size * 2, self._log_n + n)
            self._log, self._log_gen = np.resize(self._log, size), np.resize(self._log_gen, size)
        self._log[self._log_n: self._log_n + n] = blocks
        self._log_gen[self._log_n: self._log_n + n] = self.mgr.table.generation[blocks]
        self._log_n += n

    @property
    def backlog(self) -> int:
        return self._log_n

    def drain(self, limit: int = 256) -> int:
        """Apply up to ``limit`` logged accesses to the policies; returns how many."""
        n = min(limit, self._log_n)
        if n == 0:
            return 0
        t = self.mgr.table
        logged = self._log[:n]
        # a block freed since its access was logged (its id maybe taken again) is skipped
        batch = logged[(t.generation[logged] == self._log_gen[:n]) & (t.state[logged] != FREE)].tolist()
        self._log[: self._log_n - n] = self._log[n: self._log_n]
        self._log_gen[: self._log_n - n] = self._log_gen[n: self._log_n]
        self._log_n -= n
        now = self.clock()
        for b in batch:
            cls = int(self.feature_class[b])
            for tier, pol in self.policies.items():  # every policy sees every access, as in replay:
                pol.observe(b, now, cls)  # a block's history follows it from tier to tier
                if self.tracked[tier, b]:
                    pol.on_hit(b, now, cls, -1)
        return n

    # -- eviction ------------------------------------------------------------
    def _victims(self, tier: int, n: int, urgent: bool = False) -> list[int]:
        """Up to n unpinned, idle residents of ``tier``, lowest value first: a pure query of
        its policy, which skips pinned, busy and (unless ``urgent``) hinted blocks without
        touching their state. Hinted blocks come after every unhinted one: a running
        sequence's demand outranks a prefetch for a later one."""
        pol = self.policies[tier]
        t = self.mgr.table
        now = self.clock()

        def idle(bs: np.ndarray) -> np.ndarray:
            return (t.pins[bs] == 0) & (t.busy[bs] == 0) & self.protect_until.passed(bs, now)

        out = pol.victims(n, idle)
        if urgent and out.size < n:
            chosen = out

            def free(bs: np.ndarray) -> np.ndarray:
                return (t.pins[bs] == 0) & (t.busy[bs] == 0) & ~np.isin(bs, chosen)

            out = np.concatenate((out, pol.victims(n - out.size, free)))
        return out.tolist()

    def _evicted(self, tier: int, blocks: list[int]) -> None:
        """``blocks`` leave ``tier`` as its policy's victims: the policy records the evictions."""
        pol = self.policies[tier]
        now = self.clock()
        for v in blocks:
            pol.on_evict(v, now)
            self.tracked[tier, v] = False

    def _reinsert(self, tier: int, blocks: list[int]) -> None:
        for b in blocks:
            self._on_event("stored", b, tier)

    def protect(self, blocks: np.ndarray, until: float) -> None:
        """Keep hinted blocks out of victim selection until ``until`` (their acquire is due)."""
        self.protect_until.extend(blocks, until)

    def make_room(self, tier: int, n: int, urgent: bool = False) -> int:
        """Start freeing ``n`` slots in ``tier``; returns how many are free or on their way.

        ``urgent``: for a running sequence (alloc, acquire): may evict hinted blocks too."""
        mgr, t = self.mgr, self.mgr.table
        if tier == NVME:
            have = self._drop_cached_nvme(n, hinted=False)
            return self._drop_cached_nvme(n, hinted=True) if urgent and have < n else have
        have = t.free_slot_count(tier) + mgr.pending_out(tier)
        if have >= n or tier not in self.policies:
            return have
        victims = self._victims(tier, n - have, urgent)
        self._evicted(tier, victims)  # stuck ones (nowhere to go) are re-inserted below
        clean: list[int] = []
        dirty: list[int] = []
        lower_mask = np.uint8(~((1 << (tier + 1)) - 1) & 0xFF)
        for v in victims:
            sealed_below = t.state[v] == SEALED and (t.copies[v] & lower_mask)
            (clean if sealed_below else dirty).append(v)
        for v in clean:
            mgr.drop_copy(v, tier)  # listener untracks (already untracked)
        have += len(clean)
        if dirty:
            moved, stuck = self._write_back(tier, dirty)
            have += moved
            self._reinsert(tier, stuck)
        return have

    def make_ids(self, n: int) -> int:
        """Free block ids until ``n`` are free by dropping cached blocks (sealed, unreferenced,
        unpinned, idle, unhinted): NVMe-only ones oldest first, then DRAM's and HBM's policy
        victims. A block table smaller than the tiers' slots (``tiers.max_blocks``) fills with
        cached blocks while every tier has room, and nothing else frees an id: every alloc
        waited out its deadline. Returns the ids free."""
        mgr, t = self.mgr, self.mgr.table
        now = self.clock()

        def cached(bs: np.ndarray) -> np.ndarray:
            return (t.refcount[bs] == 0) & (t.pins[bs] == 0) & (t.busy[bs] == 0) & (t.state[bs] == SEALED) & \
                self.protect_until.passed(bs, now)

        lst, budget = t.nvme_idle, 4 * n + 64
        b = int(lst.next[lst.capacity]) if lst.length() else -1
        while len(t.free_blocks) < n and 0 <= b < lst.capacity and budget > 0:
            nxt, budget = int(lst.next[b]), budget - 1
            if t.copies[b] == (1 << NVME) and cached(np.array([b]))[0]:
                mgr.drop(b)
                self.dropped += 1
            b = nxt
        for tier in sorted(self.policies, reverse=True):  # DRAM's victims before HBM's
            want = n - len(t.free_blocks)
            if want <= 0:
                break
            victims = self.policies[tier].victims(want, cached).tolist()
            self._evicted(tier, victims)
            for v in victims:
                mgr.drop(v)  # every copy: the id is free
            self.dropped += len(victims)
        return len(t.free_blocks)

    def maintain(self, high: float, low: float) -> None:
        """Keep each upper tier below ``high`` full, demoting down to ``low``."""
        t = self.mgr.table
        for tier in self.policies:
            slots = t.slots_per_tier[tier]
            if t.used_slot_count(tier) - self.mgr.pending_out(tier) > high * slots:
                self.make_room(tier, slots - int(low * slots))  # down to low: floor(6 - 5.1) asked for nothing

    def _write_back(self, tier: int, blocks: list[int]) -> tuple[int, list[int]]:
        """Demote blocks one tier down (or further), dropping cached ones that fit
        nowhere. Returns (slots freed or on their way, blocks that must stay).

        A tier with a policy admits only blocks its policy finds worth a slot; the
        others go further down (or, if cached and nothing is below, are dropped):
        a block not worth DRAM must not push out DRAM blocks that are."""
        mgr, t = self.mgr, self.mgr.table
        started = 0
        pending = list(blocks)
        lowers = [d for d in range(tier + 1, len(Tier))
                  if t.slots_per_tier[d] and not (d == NVME and mgr.nvme is None)]
        if NVME in lowers and not mgr.nvme_writable():  # backing off a disk whose writes failed
            lowers.remove(NVME)
            mgr.counters["nvme_backoff_skips"] += 1
        for i, dst in enumerate(lowers):
            if not pending:
                break
            declined: list[int] = []
            if dst in self.policies:
                pending, declined = self._admitted(dst, pending, can_skip=i + 1 < len(lowers))
            self.make_room(dst, len(pending))
            k = min(len(pending), t.free_slot_count(dst))
            if k and mgr.demote(pending[:k], tier, dst, keep_source=False) is not None:
                started += k
                self.demoted += k
                pending = pending[k:]
            pending += declined
        stuck = []
        for b in pending:
            if t.refcount[b] == 0 and t.state[b] == SEALED:
                mgr.drop(b)  # nowhere below has room (or is worth it): a cached block may simply go
                self.dropped += 1
                started += 1
            else:
                stuck.append(b)
        return started, stuck

    def _admitted(self, dst: int, blocks: list[int], can_skip: bool) -> tuple[list[int], list[int]]:
        """Split ``blocks`` into those ``dst``'s policy admits and those it declines.

        A declined block may only skip ``dst`` if it has somewhere else to go: a
        tier further down, or (cached and sealed) being dropped."""
        arr = np.asarray(blocks, dtype=np.int64)
        t = self.mgr.table
        ok = self.policies[dst].admit_many(arr, self.feature_class[arr])
        if not can_skip:
            ok |= (t.refcount[arr] > 0) | (t.state[arr] != SEALED)
        self.declined += int((~ok).sum())
        return arr[ok].tolist(), arr[~ok].tolist()

    def _drop_cached_nvme(self, n: int, hinted: bool) -> int:
        """Drop cached NVMe blocks, oldest first, until ``n`` slots are free. A hinted block
        (its acquire announced) goes only when ``hinted``: otherwise a hint for a block whose
        last copy is on NVMe was lost to the first demotion that needed a disk slot."""
        mgr, t = self.mgr, self.mgr.table
        now = self.clock()
        have = t.free_slot_count(NVME)
        lst = t.nvme_idle
        b = int(lst.next[lst.capacity]) if lst.length() else -1
        budget = 4 * n + 64  # live blocks at the head are skipped, but never more than this many per call
        while have < n and b >= 0 and b < lst.capacity and budget > 0:
            nxt = int(lst.next[b])
            budget -= 1
            if t.refcount[b] == 0 and t.pins[b] == 0 and t.state[b] == SEALED and \
                    (hinted or self.protect_until.passed(b, now)):
                if t.copies[b] == (1 << NVME):
                    mgr.drop(b)
                    self.dropped += 1  # gone from the cache; an NVMe copy of a block still above is not
                else:
                    mgr.drop_copy(b, NVME)
                have += 1
            else:  # live, pinned or hinted: rotate it behind, so the next scan starts on fresh candidates
                lst.move_to_back(b)
            b = nxt
        return have

    def configure(self, params: dict) -> None:
        """Reloaded policy parameters: the dedup window here; each policy takes the ones it has
        (its own ``configure`` where it has one: a value kept inside its model)."""
        self.epoch_s = float(params.get("epoch_s", self.epoch_s))
        for pol in self.policies.values():
            configure = getattr(pol, "configure", None)
            if configure is not None:
                configure(params)
                continue
            for k, v in params.items():
                if hasattr(pol, k) and not callable(getattr(pol, k)):
                    setattr(pol, k, v)

    def configure_predictor(self, track_calibration: bool, calibration_bins: int, calibration_sample: int,
                            recalibrate: bool) -> None:
        """Reloaded ``[predictor]`` settings, to every policy that scores its decisions."""
        for pol in self.policies.values():
            setter = getattr(pol, "set_calibration", None)
            if setter is not None:
                setter(track_calibration, calibration_bins, calibration_sample, recalibrate)

    def stats(self) -> dict:
        out: dict[str, Any] = {"dropped": self.dropped, "demoted": self.demoted, "declined": self.declined,
               "access_backlog": self._log_n}
        for tier, pol in self.policies.items():
            s = pol.stats()
            out[Tier(tier).name.lower()] = {k: v for k, v in s.items() if not isinstance(v, list)}
        return out

    def close(self) -> None:
        if self._on_event in self.mgr.listeners:
            self.mgr.listeners.remove(self._on_event)
            self.mgr.batch_listeners.pop(self._on_event, None)
        if self._on_failed_move in self.mgr.failure_listeners:
            self.mgr.failure_listeners.remove(self._on_failed_move)


__all__ = ["Placement"]
