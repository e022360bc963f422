"""The remote tier in the daemon: publishing shared blocks, looking up missed keys.

Owner-thread side of ``tiers/remote.py``. Two flows, both non-blocking:

- **Publish.** Blocks offered by ``PublishRule`` are written to the cluster in
  pipelined batches, within ``bandwidth_bytes_per_s`` and the worker queue's
  depth. A block is held (``TierManager.hold``, a read hold) while a worker reads
  its bytes from its DRAM slot (or its HBM slot where HBM is host memory), so
  nothing drops or reuses the slot meanwhile, while acquires still pin and
  promote it; the hold ends when the completion is applied.
- **Lookup on miss.** A ``ref`` whose keys miss locally becomes a ``RefWaiter``
  when the tier is available: each missed key gets a placeholder block with a
  DRAM slot, a worker reads the value straight into it and verifies it, and the
  verified block becomes an ordinary cached block of this node (promoted to HBM
  by the next acquire or hint, like any DRAM block). The ref is answered when
  the reads complete or after ``lookup_timeout_s``, whichever is first: keys not
  found, not verified or not back in time are misses, which the engine
  recomputes. A degraded tier (failed batches, backing off) is skipped: misses
  at once.

Remote eviction is Redis's own (``maxmemory-policy allkeys-lru`` with
``maxmemory`` = ``capacity_bytes`` / primaries, set at start): blocks are
written by every node of the fleet and read by any, so no node's accounting
sees the cluster's contents; the shards' approximated LRU does, in O(1), and a
block evicted there is simply a miss here.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from kvtier.protocol import wire as P
from kvtier.protocol.wire import ProtocolError
from kvtier.tiers.manager import TierManager
from kvtier.tiers.remote import RemoteCompletion, RemoteTier
from kvtier.tiers.remote_store import namespace_tag
from kvtier.tiers.types import DRAM, HBM

from .acquire import Pending
from .namespaces import key_scope, scoped_keys, unscoped_keys
from .placement import Placement
from .publish import PublishRule
from .remote_config import RemoteConfig
from .session import EngineSession

LATENCY_BUCKETS = (2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5)  # seconds
MAX_CANDIDATES = 1 << 16


@dataclass
class RefWaiter(Pending):
    """A ref answered once the remote lookups of its missed keys are done (or at the deadline)."""

    session: EngineSession
    keys: np.ndarray  # the engine's keys, in request order
    found: np.ndarray  # blocks found locally at request time (-1: looked up remotely)
    wanted: np.ndarray  # scoped keys still being fetched for this ref
    seq: Optional[int]
    deadline: float
    reply_to: Any = None


@dataclass
class _Job:
    kind: str
    blocks: np.ndarray
    skeys: np.ndarray  # get: scoped keys being fetched
    started: float
    want: int = 0  # get: the namespace's block size; a value of another length is a miss
    ns: int = 0  # get: the namespace the fetched blocks are for


class RemoteOps:
    def __init__(self, mgr: TierManager, placement: Placement, cfg: RemoteConfig, tier: RemoteTier,
                 ns_ident: Callable[[int], tuple[str, Optional[tuple[int, int, str]]]], counters: Counter[str],
                 clock: Callable[[], float]) -> None:
        self.mgr, self.placement, self.cfg, self.tier = mgr, placement, cfg, tier
        self.ns_ident = ns_ident  # namespace id -> (its name, its blocks' geometry): what the remote tag binds
        self.counters = counters  # the service's: ref hits and misses count the same as local ones
        self.clock = clock
        t = mgr.table
        self.shares = t.add_column("remote_shares", np.uint16)  # reuses by other sequences on this node
        self.published = t.add_column("remote_published", np.bool_)  # a copy is in the cluster (ours or read)
        self.rule = PublishRule(cfg.publish_min_shares, placement.policies.get(DRAM))
        self.candidates: OrderedDict[int, None] = OrderedDict()
        self.jobs: dict[int, _Job] = {}
        self._unapplied: list[RemoteCompletion] = []  # taken off the tier's queue, not applied yet (``poll``)
        self.fetching: dict[int, int] = {}  # scoped key -> placeholder block
        self.waiters: list[RefWaiter] = []
        self.stats_c: Counter[str] = Counter()
        self.latency = {op: np.zeros(len(LATENCY_BUCKETS) + 1, dtype=np.int64) for op in ("put", "get")}
        self.latency_sum = {"put": 0.0, "get": 0.0}
        self._tokens = 0.0
        self._last: Optional[float] = None
        self._tags: dict[tuple[int, Any], int] = {}
        self.host_hbm = not mgr.hbm.is_cuda
        mgr.listeners.append(self._on_event)
        mgr.batch_listeners[self._on_event] = self._on_events
        mgr.held_elsewhere.append(self._held)

    # -- bookkeeping ----------------------------------------------------------------------
    def _held(self) -> tuple[np.ndarray, np.ndarray]:
        """(every block a job holds, the puts' among them: read holds) for the invariants."""
        cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.int64)  # noqa: E731
        return (cat([j.blocks for j in self.jobs.values()]),
                cat([j.blocks for j in self.jobs.values() if j.kind == "put"]))

    def _tag(self, ns: int) -> int:
        name, geometry = self.ns_ident(ns)  # one geometry a namespace: part of the tag
        tag = self._tags.get((ns, geometry))
        if tag is None:
            tag = self._tags[(ns, geometry)] = namespace_tag(self.cfg.namespace, name, geometry)
        return tag

    @staticmethod
    def _per_namespace(ns: np.ndarray, fn: Callable[[int], int], dtype: Any) -> np.ndarray:
        """``fn`` of each element's namespace, computed once per distinct namespace."""
        u, inv = np.unique(ns, return_inverse=True)
        return np.array([fn(int(n)) for n in u.tolist()], dtype=dtype)[inv]

    def _tags_of(self, ns: np.ndarray) -> np.ndarray:
        return self._per_namespace(ns, self._tag, np.uint64)

    def _scope(self, ns: int) -> int:
        return key_scope(self.ns_ident(ns)[0])

    def _block_bytes(self, ns: int) -> int:
        """The size of namespace ``ns``'s blocks, as its tag states (0: no engine registered)."""
        geometry = self.ns_ident(ns)[1]
        return int(geometry[0]) if geometry else 0

    def _on_event(self, kind: str, b: int, tier: int) -> None:
        if kind == "stored" and tier == DRAM and self.rule.wanted(self.shares[b : b + 1])[0]:
            self._offer(b)

    def _on_events(self, kind: str, blocks: np.ndarray, tier: int) -> None:
        if kind == "stored" and tier == DRAM:
            for b in blocks[self.rule.wanted(self.shares[blocks])].tolist():
                self._offer(b)

    def _offer(self, b: int) -> None:
        if self.published[b]:
            return
        self.candidates[b] = None
        self.candidates.move_to_end(b)
        if len(self.candidates) > MAX_CANDIDATES:
            self.candidates.popitem(last=False)

    def note_shared(self, blocks: np.ndarray) -> None:
        """Another sequence reused these sealed blocks (a ref hit, a seal that folded in)."""
        if blocks.size == 0:
            return
        u, n = np.unique(blocks, return_counts=True)
        before = self.rule.wanted(self.shares[u])
        self.shares[u] = np.minimum(self.shares[u].astype(np.int64) + n, np.iinfo(np.uint16).max)
        for b in u[~before & self.rule.wanted(self.shares[u])].tolist():
            self._offer(b)

    # -- lookup on miss -------------------------------------------------------------------
    def lookup(self, session: EngineSession, keys: np.ndarray, found: np.ndarray, seq: Optional[int]) -> Optional[RefWaiter]:
        """Start remote reads for ``keys`` that missed (``found`` < 0); a waiter for the ref,
        or None when nothing could be started (degraded, no DRAM room, queue full)."""
        if not self.tier.available():
            self.stats_c["lookups_skipped_degraded"] += int((found < 0).sum())
            return None
        miss = np.flatnonzero(found < 0)
        skeys = np.unique(scoped_keys(keys[miss], session.scope))
        # a key another geometry of the name holds (or a recovered block waits under) is never
        # indexed for this engine: fetching it would only be thrown away
        skeys = skeys[self.mgr.table.keys.get_many(skeys) < 0]
        new = np.array([k for k in skeys.tolist() if k not in self.fetching], dtype=np.uint64)
        if new.size:
            self.placement.make_room(DRAM, int(new.size))
            blocks = self.mgr.reserve_fetch(int(new.size), session.ns, DRAM)
            self.stats_c["lookups_no_room"] += int(new.size - blocks.size)
            new = new[: blocks.size]
            b = int(self.cfg.batch_blocks)
            for i in range(0, new.size, b):
                self._submit_get(blocks[i: i + b], new[i: i + b], session.ns)
        wanted = np.array([k for k in skeys.tolist() if k in self.fetching], dtype=np.uint64)
        if wanted.size == 0:
            return None
        w = RefWaiter(session, keys, found, wanted, seq, self.clock() + self.cfg.lookup_timeout_s)
        self.waiters.append(w)
        return w

    def _submit_get(self, blocks: np.ndarray, skeys: np.ndarray, ns: int) -> None:
        t = self.mgr.table
        raw = unscoped_keys(skeys, self._scope(ns))
        views = [self.mgr.dram.host_view(int(s)) for s in t.slot[DRAM, blocks].tolist()]
        tid = self.tier.submit("get", blocks, self._tags_of(np.full(blocks.size, ns)), raw, views)
        if tid is None:  # the queue is full: these keys are misses
            self.stats_c["queue_full"] += int(blocks.size)
            self.mgr.finish_fetch(blocks, np.zeros(blocks.size, bool), skeys, np.zeros(blocks.size), np.zeros(blocks.size))
            return
        self.jobs[tid] = _Job("get", blocks, skeys, self.clock(), self._block_bytes(ns), ns)
        for k, b in zip(skeys.tolist(), blocks.tolist()):
            self.fetching[k] = b

    def advance(self, node_lookup: Callable[[EngineSession, np.ndarray], np.ndarray],
                engines: dict[str, EngineSession]) -> list[tuple[RefWaiter, Any]]:
        """Refs whose lookups are done or out of time: (waiter, reply or ProtocolError)."""
        out: list[tuple[RefWaiter, Any]] = []
        now = self.clock()
        keep = []
        for w in self.waiters:
            pending = any(k in self.fetching for k in w.wanted.tolist())
            if pending and now <= w.deadline:
                keep.append(w)
                continue
            if engines.get(w.session.engine_id) is not w.session:  # reclaimed meanwhile: nothing to reference
                out.append((w, ProtocolError(P.UNKNOWN_ENGINE, f"engine {w.session.engine_id!r} was reclaimed")))
                continue
            found = node_lookup(w.session, w.keys)
            hit = found[found >= 0]
            if hit.size:
                self.mgr.ref_many(hit)
                w.session.add_refs(hit, w.seq)
            late = int((found[w.found < 0] < 0).sum())
            self.stats_c["lookup_timeouts"] += late if pending else 0
            self.counters["ref_hits"] += int(hit.size)
            self.counters["ref_misses"] += int(found.size - hit.size)
            out.append((w, {"blocks": P.id_bytes(found)}))
        self.waiters = keep
        return out

    # -- publish -------------------------------------------------------------------------
    def _refill(self, now: float) -> None:
        rate = self.cfg.bandwidth_bytes_per_s
        if self._last is not None:
            self._tokens = min(rate * 0.05 + self.mgr.block_bytes, self._tokens + (now - self._last) * rate)
        self._last = now

    def publish(self, now: float) -> int:
        """Write offered blocks the rule selects, as the budget and the queue allow."""
        if not self.candidates or not self.tier.writable():
            return 0
        self._refill(now)
        mgr, t = self.mgr, self.mgr.table
        bb = mgr.block_bytes
        started = 0
        later: list[int] = []
        looked = 0
        while self.candidates and self._tokens >= bb and looked < 8 * self.cfg.batch_blocks:
            n = min(len(self.candidates), int(self._tokens // bb), self.cfg.batch_blocks)
            arr = np.array([self.candidates.popitem(last=False)[0] for _ in range(n)], dtype=np.int64)
            looked += n
            ok = self.rule.select(t, arr, self.shares, self.published, mgr.corrupt, self.placement.feature_class)
            in_dram = ((t.copies[arr] >> DRAM) & 1) == 1
            in_host_hbm = (((t.copies[arr] >> HBM) & 1) == 1) & self.host_hbm
            # only blocks of the size the tag states (a namespace's engines all seal that size;
            # kept as the guard of what peers are served as whole blocks)
            ok &= t.nbytes[arr] == self._per_namespace(mgr.namespace[arr], self._block_bytes, np.int64)
            ready = ok & (t.busy[arr] == 0) & (t.pins[arr] == 0) & (in_dram | in_host_hbm)
            later += arr[ok & ~ready].tolist()  # in use now: offered again next turn
            go = arr[ready]
            if go.size == 0:
                continue
            src = np.where(in_dram[ready], DRAM, HBM)
            views = [mgr.dram.host_view(int(t.slot[DRAM, b])) if s == DRAM else mgr.hbm.host_view(int(t.slot[HBM, b]))
                     for b, s in zip(go.tolist(), src.tolist())]
            ns = mgr.namespace[go]
            raw = unscoped_keys(t.key[go], self._per_namespace(ns, self._scope, np.uint64))
            tid = self.tier.submit("put", go, self._tags_of(ns), raw, views,
                                   t.nbytes[go].astype(np.int64), t.checksum[go])
            if tid is None:
                later += go.tolist()
                self.stats_c["queue_full"] += 1
                break
            mgr.hold(go)
            self.jobs[tid] = _Job("put", go, np.zeros(0, np.uint64), now)
            self._tokens -= int(t.nbytes[go].sum())
            started += int(go.size)
        for b in later:
            self.candidates[b] = None
        return started

    # -- completions -----------------------------------------------------------------------
    def poll(self) -> int:
        """Apply finished remote jobs. Each completion's bookkeeping ends before a listener's
        error escapes it, and the completions after one that raised are applied by the next
        poll (taken off the tier's queue, they had been lost: their keys fetching for ever)."""
        done = self._unapplied + self.tier.poll()
        self._unapplied = []
        for i, c in enumerate(done):
            try:
                with self.mgr.deferring_listeners():
                    self._apply(c)
            except BaseException:
                self._unapplied = done[i + 1:]
                raise
        return len(done)

    def _apply(self, c: RemoteCompletion) -> None:
        job = self.jobs.pop(c.tid)
        s = self.stats_c
        op = job.kind
        self.latency[op][bisect.bisect_left(LATENCY_BUCKETS, c.seconds)] += 1
        self.latency_sum[op] += c.seconds
        s[f"{op}_bytes"] += c.nbytes
        s[f"{op}_batches"] += 1
        if c.error:
            s[f"errors_{op}"] += 1
        if op == "put":
            self.mgr.unhold(job.blocks)
            self.published[job.blocks[c.ok]] = True
            s["published"] += int(c.ok.sum())
            for b in job.blocks[~c.ok].tolist():  # offered again: tried once the tier's backoff ends
                self._offer(b)
            return
        for k in job.skeys.tolist():
            self.fetching.pop(k, None)
        if c.ok.any():  # a verified value of another length under this tag: a miss, never a short block
            c.ok = c.ok & (c.lengths == job.want)
        got = self.mgr.finish_fetch(job.blocks, c.ok, job.skeys, c.lengths, c.checksums, DRAM)
        mine = got[c.ok]
        mine = mine[(mine >= 0) & (self.mgr.namespace[np.maximum(mine, 0)] == job.ns)]  # not another's
        self.published[mine] = True
        s["hits"] += int(mine.size)
        s["misses"] += int(job.blocks.size - mine.size)
        s["corrupt"] += c.corrupt

    def busy(self) -> bool:
        return bool(self.jobs or self.waiters or self._unapplied)

    def stats(self) -> dict:
        s = self.stats_c
        tier = self.tier
        return {"enabled": True, "state": "degraded" if tier.degraded else "writes refused" if tier.refusing else "ok",
                "last_error": tier.last_error if tier.degraded else tier.last_refusal if tier.refusing else "",
                "namespace": self.cfg.namespace, "nodes": list(self.cfg.nodes),
                "hits": s["hits"], "misses": s["misses"], "corrupt": s["corrupt"], "published": s["published"],
                "put_bytes": s["put_bytes"], "get_bytes": s["get_bytes"],
                "errors": {"put": s["errors_put"], "get": s["errors_get"]},
                "lookups_skipped_degraded": s["lookups_skipped_degraded"], "lookups_no_room": s["lookups_no_room"],
                "lookup_timeouts": s["lookup_timeouts"], "queue_full": s["queue_full"],
                "candidates": len(self.candidates), "in_flight": len(self.jobs), "fetching": len(self.fetching),
                "latency_histogram": {op: {"le": list(LATENCY_BUCKETS), "counts": self.latency[op].tolist(),
                                           "sum": self.latency_sum[op]} for op in self.latency}}

    def close(self) -> None:
        """Stop the workers and apply what they finished (holds released, placeholders dropped)."""
        self.tier.close()
        self.poll()
        for job in list(self.jobs.values()):  # never completed (a worker died): release as failed
            if job.kind == "put":
                self.mgr.unhold(job.blocks)
            else:
                n = job.blocks.size
                self.mgr.finish_fetch(job.blocks, np.zeros(n, bool), job.skeys, np.zeros(n), np.zeros(n))
        self.jobs.clear()
        self.fetching.clear()


def wait_idle(ops: RemoteOps, timeout: float = 10.0) -> None:
    """Apply completions until nothing is in flight (tests and benchmarks driving a manager directly)."""
    end = time.monotonic() + timeout
    while ops.jobs and time.monotonic() < end:
        ops.poll()
        time.sleep(0.0005)


__all__ = ["RemoteOps", "RefWaiter", "LATENCY_BUCKETS", "wait_idle"]
