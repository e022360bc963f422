"""Residency operations: acquire (blocking or polled), release, and schedule hints.

Kept apart from the block lifecycle because it is the hot path: an acquire
whose blocks are all resident is one vectorised pin and a log entry; anything
else becomes a ``Waiter`` that ``advance_waiters`` moves forward in the owner
loop.
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from kvtier.protocol import wire as P
from kvtier.protocol.wire import ProtocolError
from kvtier.tiers.types import HBM, Tier

from .acquire import Waiter, failure, pin_landed, progress, source_tiers, unpin_waiter, unservable
from .block_ops import refuse_refs_only
from .node import Node
from .session import EngineSession

if TYPE_CHECKING:
    from .config import KvtierConfig

STALL_BUCKETS = (1e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)  # seconds
HIT_COUNTERS = tuple(f"hits_{t.name.lower()}" for t in Tier)


class ResidencyOps:
    def __init__(self, node: Node, cfg: "KvtierConfig", counters: Counter[str], clock: Callable[[], float]) -> None:
        self.node = node
        self.cfg = cfg
        self.counters = counters  # the service's: one set of counters for the whole daemon
        self.clock = clock
        self.waiters: dict[int, Waiter] = {}
        self.tickets = itertools.count(1)
        self.stall_counts = np.zeros(len(STALL_BUCKETS) + 1, dtype=np.int64)  # histogram (last: +Inf)
        self.stall_sum = 0.0

    def pinned_by_waiters(self, session: EngineSession) -> set[int]:
        """Blocks that ``session``'s unfinished acquires have pinned (their pins are the waiters')."""
        return set(self._waiter_pins(session))

    def _waiter_pins(self, session: EngineSession) -> Counter:
        """Pins per block that ``session``'s unfinished acquires hold."""
        out: Counter = Counter()
        for w in self.waiters.values():
            if w.session is session:
                out.update(w.blocks[w.pinned].tolist())
        return out

    def drop_waiters(self, session: EngineSession) -> list[Waiter]:
        """Forget ``session``'s acquires; returns those owed a reply. Their pins are
        counted in the session's and released (or fenced) with them."""
        dropped = [w for w in self.waiters.values() if w.session is session]
        for w in dropped:
            self.waiters.pop(w.ticket)
        return [w for w in dropped if w.blocking]

    def op_acquire(self, session: EngineSession, args: Any) -> Any:
        refuse_refs_only(session, "acquire")
        mgr = self.node.mgr
        blocks = self.node.resolve(session, args)
        t = mgr.table
        if blocks.size > t.slots_per_tier[HBM]:
            raise ProtocolError(P.NO_SPACE, f"{blocks.size} blocks can never fit {t.slots_per_tier[HBM]} HBM slots")
        now = self.clock()
        copies = t.copies[blocks]
        resident = t.idle_in(blocks, HBM)
        c = self.counters
        c["acquires"] += 1
        c["acquire_blocks"] += int(blocks.size)
        if resident.all():  # the hot path: no waiter, one vectorised pin
            c["acquires_on_time"] += 1
            c["hits_hbm"] += int(blocks.size)
            slots = mgr.pin_many(blocks, checked=True)
            session.pins.add(blocks)
            self.stall_counts[0] += 1  # no stall: the cheapest bucket, no search
            self.node.placement.log_access(blocks)
            self.node.prefetcher.note_acquired(blocks)
            return {"done": True, "ticket": 0, "blocks": P.id_bytes(blocks), "slots": P.id_bytes(slots)}
        broken = unservable(blocks[~resident], mgr)
        if broken is not None:
            raise ProtocolError(*broken)
        src = np.where(resident, HBM, source_tiers(copies, HBM))
        for name, n in zip(HIT_COUNTERS, np.bincount(src[src >= 0], minlength=len(Tier)).tolist()):
            c[name] += n
        timeout = args.timeout_s if args.timeout_s is not None else self.cfg.server.acquire_timeout_s
        w = Waiter(next(self.tickets), session, blocks, now + timeout, now, args.wait, t.generation[blocks].copy())
        progress(w, mgr, self.node.placement, self.node.layers)
        self.waiters[w.ticket] = w
        if not args.wait:
            return self._pending_reply(w)
        return w

    def _finish(self, w: Waiter) -> dict:
        self.waiters.pop(w.ticket, None)
        stall = self.clock() - w.started
        self.counters["stall_ns"] += int(stall * 1e9)
        self.stall_counts[bisect.bisect_left(STALL_BUCKETS, stall)] += 1
        self.stall_sum += stall
        self.node.placement.log_access(w.blocks)
        self.node.prefetcher.note_acquired(w.blocks)
        return {"done": True, "ticket": w.ticket, "blocks": P.id_bytes(w.blocks), "slots": P.id_bytes(w.slots)}

    def op_acquire_poll(self, session: EngineSession, args: Any) -> dict:
        w = self.waiters.get(args.ticket)
        if w is None or w.session is not session or w.blocking:
            raise ProtocolError(P.INVALID, f"unknown acquire ticket {args.ticket}")
        progress(w, self.node.mgr, self.node.placement, self.node.layers)
        if w.done:
            return self._finish(w)
        broken = failure(w, self.node.mgr)
        if broken is not None:
            unpin_waiter(w, self.node.mgr)
            self.waiters.pop(w.ticket, None)
            raise ProtocolError(*broken)
        if self.clock() > w.deadline:
            unpin_waiter(w, self.node.mgr)
            self.waiters.pop(w.ticket, None)
            raise ProtocolError(P.TIMEOUT, f"acquire {w.ticket} missed its deadline")
        return self._pending_reply(w)

    def _pending_reply(self, w: Waiter) -> dict:
        """Per block of a waiting acquire: pinned, layers landed so far, and its HBM slot
        (reserved already for blocks in flight, so layer l may be read once it landed)."""
        t = self.node.mgr.table
        parts = self.node.layer_parts(w.session.block_bytes, w.session.layout)  # what register told it
        layers = self.node.mgr.parts_ready(w.blocks, self.node.layers) * parts // self.node.layers
        layers[~w.pinned & t.idle_in(w.blocks, HBM)] = 0  # resident but not ours yet: it may still go
        slots = np.where(w.pinned, w.slots, np.where(layers > 0, t.slot[HBM, w.blocks], -1))
        return {"done": False, "ticket": w.ticket, "ready": w.pinned.tobytes(), "layers": parts,
                "layers_ready": P.id_bytes(layers), "slots": P.id_bytes(slots)}

    def pin_landed(self) -> None:
        """Every waiter pins its blocks that landed in HBM (``acquire.pin_landed``): called
        right after transfer completions are applied, before any room is made."""
        for w in self.waiters.values():
            pin_landed(w, self.node.mgr)

    def advance_waiters(self) -> list[tuple[Waiter, Any]]:
        """Progress blocking acquires: (waiter, result dict or ProtocolError) for each finished."""
        out: list[tuple[Waiter, Any]] = []
        now = self.clock()
        for w in list(self.waiters.values()):
            if not w.blocking:  # pin what landed now, before background work could move it
                if now > w.deadline + 60:  # abandoned non-blocking ticket
                    unpin_waiter(w, self.node.mgr)
                    self.waiters.pop(w.ticket, None)
                elif not w.done:
                    progress(w, self.node.mgr, self.node.placement, self.node.layers)
                continue
            progress(w, self.node.mgr, self.node.placement, self.node.layers)
            broken = None if w.done else failure(w, self.node.mgr)
            if w.done:
                out.append((w, self._finish(w)))
            elif broken is not None:
                unpin_waiter(w, self.node.mgr)
                self.waiters.pop(w.ticket, None)
                self.counters["acquire_failures"] += 1
                out.append((w, ProtocolError(*broken)))
            elif now > w.deadline:
                unpin_waiter(w, self.node.mgr)
                self.waiters.pop(w.ticket, None)
                self.counters["acquire_timeouts"] += 1
                out.append((w, ProtocolError(P.TIMEOUT, f"acquire of {w.blocks.size} blocks missed its deadline")))
        return out

    def op_release(self, session: EngineSession, args: Any) -> dict:
        mgr = self.node.mgr
        blocks = self.node.resolve(session, args, allow_keys=False)
        unheld = ~session.pins.pinned(blocks)
        if unheld.any():
            b = int(blocks[np.argmax(unheld)])
            raise ProtocolError(P.INVALID, f"block {b} is not pinned by engine {session.engine_id!r}")
        waiting = self._waiter_pins(session) if self.waiters else None
        if waiting:  # pins an unfinished acquire holds are its own: it drops them when it ends
            own = session.pins[blocks] - np.array([waiting.get(b, 0) for b in blocks.tolist()], dtype=np.int64)
            if (own <= 0).any():
                b = int(blocks[np.argmax(own <= 0)])
                raise ProtocolError(P.INVALID, f"block {b} is pinned only by an unfinished acquire of engine "
                                               f"{session.engine_id!r}; release it after the acquire completes")
        mgr.unpin_many(blocks, checked=True)
        session.pins.sub(blocks)
        return {"released": int(blocks.size)}

    def op_hint(self, session: EngineSession, args: Any) -> dict:
        blocks = self.node.resolve(session, args)
        due = self.clock() + float(args.deadline_s)
        self.node.prefetcher.hint(blocks, due, self.node.mgr.table.generation[blocks].copy())
        # protect through the deadline plus a grace period, then they compete like any block
        self.node.placement.protect(blocks, due + max(1.0, float(args.deadline_s)))
        return {"hinted": int(blocks.size)}

