"""Block lifecycle operations: alloc (waiting for room if asked), seal, ref, free, clear, check.

Each op validates its whole request before it changes anything, so a bad
request is an error reply and no state moves. Table changes go through the
manager's methods; the engines' own holdings (refs, pins, sequences) are
their sessions'.
"""

from __future__ import annotations

import errno
from collections import Counter
from typing import Any, Callable, Optional

import numpy as np

from kvtier.protocol import wire as P
from kvtier.protocol.wire import ProtocolError
from kvtier.tiers.types import HBM, OPEN

from .acquire import AllocWaiter
from .config import KvtierConfig
from .namespaces import scoped_keys
from .node import Node
from .session import EngineSession


def refuse_refs_only(session: EngineSession, op: str) -> None:
    """A refs-only engine sees other geometries' blocks: it must never touch bytes."""
    if session.refs_only:
        raise ProtocolError(P.INVALID, f"engine {session.engine_id!r} registered refs_only: it cannot {op}")


class BlockOps:
    def __init__(self, node: Node, cfg: KvtierConfig, counters: Counter[str], clock: Callable[[], float],
                 engines: dict[str, EngineSession]) -> None:
        self.node = node
        self.cfg = cfg
        self.counters = counters  # the service's: one set of counters for the whole daemon
        self.clock = clock
        self.engines = engines  # the service's registry, read only: a waiter of a gone engine is dropped
        self.alloc_waiters: list[AllocWaiter] = []
        # blocks a session's unfinished acquires have pinned (ResidencyOps'); seal must not take those pins
        self.acquiring: Callable[[EngineSession], set[int]] = lambda session: set()
        # pins what landed for the acquires waiting on it (the service's, after applied completions)
        self.pin_landed: Callable[[], None] = lambda: None

    # -- alloc ------------------------------------------------------------------------
    def op_alloc(self, session: EngineSession, args: Any) -> Any:
        refuse_refs_only(session, "alloc")
        hbm_slots = self.node.mgr.table.slots_per_tier[HBM]
        if args.n > self.cfg.server.max_batch_blocks:
            raise ProtocolError(P.TOO_LARGE, f"alloc of {args.n} exceeds {self.cfg.server.max_batch_blocks}")
        if args.n > hbm_slots:
            raise ProtocolError(P.NO_SPACE, f"{args.n} blocks can never fit {hbm_slots} HBM slots")
        result = self._try_alloc(session, args)
        if result is not None:
            return result
        if not args.wait:
            raise ProtocolError(P.NO_SPACE, self._no_room(args.n, "yet; demotions are in flight, retry"))
        timeout = args.timeout_s if args.timeout_s is not None else self.cfg.server.acquire_timeout_s
        w = AllocWaiter(session, args, self.clock() + timeout)
        self.alloc_waiters.append(w)
        return w

    def _try_alloc(self, session: EngineSession, args: Any) -> Optional[dict]:
        mgr, placement = self.node.mgr, self.node.placement
        blocks = mgr.alloc(args.n, full=True, ns=session.ns)  # the engine writes all of each slot
        if blocks is None:
            placement.make_room(HBM, args.n, urgent=True)
            placement.make_ids(args.n)
            blocks = mgr.alloc(args.n, full=True, ns=session.ns)
        if blocks is None:
            return None
        session.add_refs(blocks, args.seq, unique=True)
        if args.pin:  # the engine writes them next: keep them in HBM until it releases them
            mgr.pin_many(blocks, checked=True)
            session.pins.add(blocks)
        placement.on_alloc(blocks, continues=session.continues(args.seq, blocks.size))
        self.counters["allocs"] += int(blocks.size)
        return {"blocks": P.id_bytes(blocks), "slots": P.id_bytes(mgr.table.slot[HBM, blocks])}

    def _no_room(self, n: int, when: str) -> str:
        """What an alloc of ``n`` lacks: block ids (none cached left to drop) or HBM slots."""
        t = self.node.mgr.table
        if len(t.free_blocks) < n:
            return (f"no free block ids for {n} blocks {when} (the block table's {t.max_blocks} ids, "
                    "tiers.max_blocks, are held by blocks in use)")
        return f"no room for {n} blocks in HBM {when}"

    def advance_allocs(self) -> list[tuple[AllocWaiter, Any]]:
        """Retry waiting allocs in arrival order: (waiter, result or ProtocolError) for each finished."""
        out: list[tuple[AllocWaiter, Any]] = []
        now = self.clock()
        keep = []
        for w in self.alloc_waiters:
            if w.session.engine_id not in self.engines:
                continue  # its engine was reclaimed: nobody to answer
            result = self._try_alloc(w.session, w.args)
            if result is not None:
                out.append((w, result))
            elif now > w.deadline:
                self.counters["alloc_timeouts"] += 1
                out.append((w, ProtocolError(P.NO_SPACE, self._no_room(w.args.n, "before the deadline"))))
            else:
                keep.append(w)
        self.alloc_waiters = keep
        return out

    def drop_waiters(self, session: EngineSession) -> list[AllocWaiter]:
        """Forget ``session``'s waiting allocs; returns them (each is owed a reply)."""
        dropped = [w for w in self.alloc_waiters if w.session is session]
        self.alloc_waiters = [w for w in self.alloc_waiters if w.session is not session]
        return dropped

    # -- seal / ref / free ---------------------------------------------------------------
    def op_seal(self, session: EngineSession, args: Any) -> dict:
        refuse_refs_only(session, "seal")
        node = self.node
        mgr, t = node.mgr, node.mgr.table
        blocks = node.ids(args.blocks, "blocks")
        keys = scoped_keys(node.ids(args.keys, "keys", np.uint64), session.scope)
        if blocks.size != keys.size:
            raise ProtocolError(P.BAD_REQUEST, f"{blocks.size} blocks but {keys.size} keys")
        if np.unique(blocks).size != blocks.size:
            raise ProtocolError(P.INVALID, "a block is named twice in one request")
        limit = session.block_bytes or mgr.block_bytes  # the engine's own block size, as it registered
        if args.nbytes is not None and args.nbytes > limit:
            raise ProtocolError(P.INVALID, f"nbytes {args.nbytes} exceeds the block size {limit} "
                                           f"engine {session.engine_id!r} registered")
        acquiring = self.acquiring(session)
        for b in blocks.tolist():  # validate all before sealing any
            if session.refs.get(b, 0) <= 0:
                raise ProtocolError(P.INVALID, f"block {b} is not held by engine {session.engine_id!r}")
            if b in acquiring:  # sealing may fold it into a shared block and drop our pins: the acquire's too
                raise ProtocolError(P.INVALID, f"block {b} is in an unfinished acquire; finish it before sealing")
            if t.state[b] != OPEN:
                raise ProtocolError(P.INVALID, f"block {b} is already sealed")
            if not t.idle_in(np.array([b]), HBM)[0]:
                raise ProtocolError(P.INVALID, f"block {b} must be resident in HBM and idle to seal")
            if t.pins[b] != session.pins[b]:
                raise ProtocolError(P.INVALID, f"block {b} is pinned by another engine")
        out = blocks.copy()  # a block not sealed yet (an error midway) did not move
        nbytes = args.nbytes if args.nbytes is not None else (session.block_bytes or mgr.block_bytes)
        cont = session.continues(args.seq, blocks.size)
        try:
            for i, (b, k) in enumerate(zip(blocks.tolist(), keys.tolist())):
                existing = t.lookup(k)
                folds = existing >= 0 and mgr.namespace[existing] == session.ns and not mgr.corrupt[existing]
                if folds and args.fold_identical_only:  # checked once, here: the manager keeps b if not
                    folds = mgr.same_bytes(b, existing, nbytes)
                if session.pins[b] and folds:  # folding into a shared block: our pins on b go (not when the
                    # key is another namespace's: b is sealed unindexed and stays ours, pinned as it was)
                    while session.pins[b]:
                        mgr.unpin_many(np.array([b]), checked=True)
                        session.pins[b] -= 1
                c = mgr.seal(b, k, nbytes, fold=folds or not args.fold_identical_only)
                out[i] = c
                if c != b:
                    session.fold(b, c)
                    self.counters["seal_shared"] += 1
                    if node.remote is not None:
                        node.remote.note_shared(np.array([c]))
                else:
                    node.placement.on_seal(c, cont, int(blocks.size))
        finally:  # the engine's sequences list what its references moved to, even after an error
            moved = out != blocks
            if moved.any():
                session.relist(blocks[moved], out[moved], args.seq)
        self.counters["seals"] += int(blocks.size)
        return {"blocks": P.id_bytes(out)}

    def op_ref(self, session: EngineSession, args: Any) -> Any:
        mgr, remote = self.node.mgr, self.node.remote
        keys = self.node.ids(args.keys, "keys", np.uint64)
        found = self.node.lookup(session, keys)
        if remote is not None and (found < 0).any():  # look the misses up in the cluster: answered later
            w = remote.lookup(session, keys, found, args.seq)
            if w is not None:
                return w
        hit = found[found >= 0]
        if remote is not None and hit.size:
            remote.note_shared(hit)
        if hit.size:
            mgr.ref_many(hit)
            session.add_refs(hit, args.seq)
        self.counters["ref_hits"] += int(hit.size)
        self.counters["ref_misses"] += int(keys.size - hit.size)
        return {"blocks": P.id_bytes(found)}

    def op_lookup(self, session: EngineSession, args: Any) -> dict:
        """Which keys the engine's namespace holds, and the fastest tier holding each
        (-1: none); changes nothing, so a scheduler may ask before deciding to load."""
        t = self.node.mgr.table
        found = self.node.lookup(session, self.node.ids(args.keys, "keys", np.uint64))
        tiers = np.full(found.size, -1, dtype=np.int8)
        hit = found >= 0
        copies = t.copies[found[hit]].astype(np.int64)
        tiers[hit] = np.where(copies & 1, 0, np.where(copies & 2, 1, np.where(copies & 4, 2, -1)))
        self.counters["lookups"] += 1
        return {"blocks": P.id_bytes(found), "tiers": tiers.tobytes()}

    def op_free(self, session: EngineSession, args: Any) -> dict:
        mgr = self.node.mgr
        blocks = self.node.resolve(session, args, allow_keys=False)
        held, pins = session.refs[blocks], session.pins[blocks]
        drops = self._references_named(session, blocks, held, args.seqs or [])
        short = held < drops
        if short.any():
            i = int(np.argmax(short))
            raise ProtocolError(P.INVALID, f"block {int(blocks[i])} is held {int(held[i])} times by engine "
                                           f"{session.engine_id!r}; the request frees it {int(drops[i])} times")
        pinned = pins > held - drops  # a pin needs a reference of its own (two sequences of one
        # engine sharing a block: one may free its reference while the other holds its pin;
        # pins are counted per engine, not per sequence)
        if pinned.any():
            raise ProtocolError(P.INVALID, f"block {int(blocks[np.argmax(pinned)])} is pinned; release it before freeing")
        dropped = [0] * blocks.size
        try:
            for i, (b, n) in enumerate(zip(blocks.tolist(), drops.tolist())):
                for _ in range(n):
                    mgr.free(b, allow_pinned=True)  # our pins were checked above; others' pins are theirs
                    dropped[i] += 1
        finally:  # the engine's counts follow the table's, reference for reference
            went = np.asarray(dropped, dtype=np.int64)
            some = went > 0
            session.refs[blocks[some]] = held[some] - went[some]
        for s in args.seqs or []:
            session.seqs.pop(s, None)
        if args.blocks is not None and len(args.blocks):  # by id: a listing may outlive its reference
            session.loose = True
        session.forget_blocks(blocks)
        self.counters["frees"] += int(blocks.size)
        return {"freed": int(blocks.size)}

    @staticmethod
    def _references_named(session: EngineSession, blocks: np.ndarray, held: np.ndarray,
                          seqs: list[int]) -> np.ndarray:
        """References a free drops, per block of ``blocks`` (unique; the named sequences'
        blocks among them): one per place a named sequence holds it (two sequences sharing
        a prefix block, or one naming a block twice, took one reference each time), and one
        for a block named on its own. At most what the engine holds: a sequence still lists
        a block the engine freed by id, as long as it holds it at all."""
        listed = np.zeros(blocks.size, dtype=np.int64)
        entries = session.seq_entries(list(dict.fromkeys(seqs)))  # a sequence named twice is freed once
        if entries.size:
            u, times = np.unique(entries, return_counts=True)
            if u.size == blocks.size and (u == blocks).all():  # sequences only: ``resolve``'s sorted union
                listed = times
            else:
                order = np.argsort(blocks, kind="stable")
                at = order[np.minimum(np.searchsorted(blocks[order], u), blocks.size - 1)]
                ok = blocks[at] == u  # (every listed block is among ``blocks``: ``resolve`` added them)
                listed[at[ok]] = times[ok]
        return np.maximum(1, np.minimum(listed, held))

    # -- whole-node ------------------------------------------------------------------------
    def op_clear(self, session: Optional[EngineSession], args: Any) -> dict:
        """Drop every cached (unreferenced, unpinned) block: AllBlocksCleared. Transfers in
        flight finish first; a disk too slow to finish them in time (``CLEAR_DRAIN_S``), or
        one that refuses the new header key (``void_headers``), is an error, not a bug:
        nothing is dropped."""
        try:
            dropped = self.node.mgr.drop_cached(landed=self.pin_landed)
        except TimeoutError as e:  # (an OSError too: before the disk's errors)
            raise ProtocolError(P.TIMEOUT, f"clear: {e} (transfers in flight to a slow disk); nothing was "
                                           "dropped, try again") from None
        except OSError as e:
            code = P.NO_SPACE if e.errno == errno.ENOSPC else P.IO_ERROR
            raise ProtocolError(code, f"clear: the NVMe tier's headers cannot be voided ({e}); nothing was dropped") from None
        self.counters["cleared_blocks"] += dropped  # kvtier_blocks_dropped_total counts these too
        self.node.events.all_cleared()
        return {"dropped": dropped}

    def op_check(self, session: Optional[EngineSession], args: Any) -> dict:
        """Verify every metadata invariant (tests, `kvtier stats --check`)."""
        mgr = self.node.mgr
        try:
            mgr.check_invariants()
        except RuntimeError as e:
            raise ProtocolError(P.INTERNAL, f"invariant broken: {e}") from None
        t = mgr.table
        held = sum((np.asarray(s.pins) for s in self.engines.values()), np.zeros(t.max_blocks, dtype=np.int64))
        if (t.pins < held).any() or (held < 0).any():
            b = int(np.argmax((t.pins < held) | (held < 0)))
            raise ProtocolError(P.INTERNAL, f"block {b}: engines hold {held[b]} pins, table has {t.pins[b]}")
        return {"ok": True}


__all__ = ["BlockOps"]
