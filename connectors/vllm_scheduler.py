"""The scheduler half of the vLLM connector: what to load from kvtier, what to save.

Runs in vLLM's scheduler (no tensors). For a new request it asks the daemon which
of the request's full blocks kvtier holds (``lookup``, no reference taken), takes
the longest held prefix beyond vLLM's own cache hit, and hints those blocks at
once, so DRAM/NVMe -> staging promotions run while vLLM schedules. A prefix whose
blocks are all in staging or DRAM is loaded layer by layer in the request's first
forward (sync); one with a block on NVMe (or only remote) is loaded async: vLLM
parks the request until the worker reports the load finished, so no forward waits
on a disk. Each step it hands the worker the loads it promised and the blocks that
became full (to save), as plain lists: vLLM block ids and vLLM block hashes.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from kvtier.client.replies import KvtierError
from kvtier.client.tier_client import TierClient

from .keys import block_keys

log = logging.getLogger("kvtier.connectors.vllm")

TIER_SOURCES = ("device", "host", "disk")  # kvtier tier -> vLLM CacheHitSource value
SYNC_TIERS = 2  # tiers below this (staging, DRAM) load in the forward; NVMe and remote-only load async
MAX_TRACKED = 1 << 16  # block hashes remembered to find shared prefixes


@dataclass
class Transfer:
    """Blocks of one request to move between vLLM's KV and kvtier (same order in both lists)."""
    req_id: str
    block_ids: list[int]
    hashes: list[Any]
    segment: list[str] = field(default_factory=list)  # per block: "system", "user" (prompt) or "assistant"
    cont: bool = False   # the request continues a conversation (its first two blocks were held already)
    span: int = 0        # new blocks the request adds (the predictor's features)


@dataclass
class _Req:
    request: Any
    local: int = 0                     # tokens vLLM's own prefix cache had
    block_ids: list[int] = field(default_factory=list)
    saved_upto: int = 0                # leading blocks kvtier holds (looked up, loaded or saved)
    load: Optional[Transfer] = None
    tiers: list[int] = field(default_factory=list)  # tier of each block of the pending load
    load_async: bool = False           # the pending load waits for NVMe: vLLM parks the request
    saved_any: bool = False            # the worker got saves of it: vLLM frees its blocks when told
    saved_epoch: int = 0               # vLLM's preemption count of the request at its last saves
    loaded: int = 0                    # blocks loaded from kvtier (for the request's output)
    cont: bool = False                 # features told to the daemon with its saves
    span: int = 0
    system: int = 0                    # leading blocks shared with another conversation
    failed: int = 0                    # ... of which failed (recomputed)
    # the first block a load of it failed at: never offered again (vLLM asks again after a
    # failure that left it nothing computed, and the same load failed the same way for ever)
    load_limit: Optional[int] = None


class SchedulerSide:
    """``clients``: one per tensor-parallel rank, each registered in that rank's namespace (a rank
    holds its own shard of every block): a block is a hit only if every rank holds it."""

    def __init__(self, clients: "TierClient | list[TierClient]", block_size: int, hint_deadline_s: float = 0.05) -> None:
        self.clients = clients if isinstance(clients, list) else [clients]
        self.client = self.clients[0]
        self.block_size = block_size
        self.hint_deadline_s = hint_deadline_s
        self.reqs: dict[str, _Req] = {}
        self.async_loads: list[Transfer] = []  # promised async loads not yet handed to the worker
        self.hit_tokens = np.zeros(len(TIER_SOURCES), dtype=np.int64)  # loaded tokens by source tier
        self.counts = {"sync_loads": 0, "async_loads": 0}
        self.children: OrderedDict[Any, Any] = OrderedDict()  # block hash -> the next block first seen after it
        self.branches: OrderedDict[Any, int] = OrderedDict()  # hash -> blocks up to it: a shared prefix

    def _shared_prefix(self, hashes: list[Any]) -> int:
        """Leading blocks this request shares with a conversation that continued differently (a
        shared system prompt): a block seen followed by two different blocks ends a shared prefix.
        Newly found shared blocks kvtier holds are re-tagged ``system``. Bounded memory (oldest forgotten first)."""
        shared = 0
        for i in range(len(hashes) - 1):
            h, nxt = hashes[i], hashes[i + 1]
            seen = self.children.get(h)
            if seen is None:
                self.children[h] = nxt
                if len(self.children) > MAX_TRACKED:
                    self.children.popitem(last=False)
            elif seen != nxt and h not in self.branches:
                self.branches[h] = i + 1
                if len(self.branches) > MAX_TRACKED:
                    self.branches.popitem(last=False)
                keys = block_keys(hashes[:i + 1])
                try:
                    for c in self.clients:
                        ids, _ = c.lookup(keys)
                        if np.any(ids >= 0):
                            c.report_segment(ids[ids >= 0], "system")
                except KvtierError as e:  # a placement hint, nothing more: lost with the daemon
                    log.debug("kvtier: tagging a shared prefix failed: %s", e)
            shared = max(shared, self.branches.get(h, 0))
        return shared

    # -- vLLM hooks ---------------------------------------------------------------
    def matched(self, request: Any, num_computed: int) -> tuple[int, bool]:
        """(tokens beyond ``num_computed`` that kvtier can load, whether the load is async):
        whole blocks; at least one prompt token is always left for vLLM to compute."""
        bs = self.block_size
        hashes = request.block_hashes
        limit = min(len(hashes), (request.num_tokens - 1) // bs)
        start = num_computed // bs
        st = self.reqs.get(request.request_id)
        if st is None:
            st = self.reqs[request.request_id] = _Req(request)
            st.system = self._shared_prefix(list(hashes))
        st.local = num_computed
        st.saved_upto = start
        st.tiers = []
        st.load_async = False
        st.cont, st.span = start >= 2, max(len(hashes) - start, 0)
        if st.load_limit is not None:
            limit = min(limit, st.load_limit)
        slots = int(self.client.info.get("hbm_slots", 0) or 0)  # a load is acquired into staging at once:
        if slots:  # more blocks than it has slots was refused as "can never fit", every time
            limit = min(limit, start + slots)
        if limit <= start or not all([c.reattach() for c in self.clients]):
            return 0, False  # (no daemon: vLLM computes everything, it never stops for kvtier)
        try:
            ids, tiers = self.lookup(block_keys(hashes[start:limit]))
        except KvtierError as e:
            log.warning("kvtier: lookup failed (%s); vLLM computes the prompt", e)
            return 0, False
        miss = np.flatnonzero(np.any(ids < 0, axis=0))
        p = int(miss[0]) if miss.size else int(ids.shape[1])
        st.cont, st.span = start + p >= 2, max(len(hashes) - start - p, 0)
        try:
            for c, rank_ids in zip(self.clients, ids[:, :p] if p else []):
                c.hint(blocks=rank_ids, deadline_s=self.hint_deadline_s)  # promotions start now
        except KvtierError as e:  # a hint only saves time: the load finds its blocks without it
            log.debug("kvtier: hint failed: %s", e)
        st.saved_upto = start + p
        st.tiers = tiers[:p].tolist()
        st.load_async = bool(np.any((tiers[:p] < 0) | (tiers[:p] >= SYNC_TIERS)))
        return p * bs, st.load_async

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """([ranks, n] block ids, -1 where a rank lacks the key; the slowest tier per key
        over the ranks that hold it, since a load waits for its slowest rank)."""
        found = [c.lookup(keys) for c in self.clients]
        ids = np.stack([f[0] for f in found])
        tiers = np.stack([f[1] for f in found])
        slowest = np.where(np.any(tiers < 0, axis=0) & np.any(ids >= 0, axis=0), -1, tiers.max(axis=0))
        return ids, slowest

    def after_alloc(self, request: Any, block_ids: list[int], num_external: int) -> None:
        st = self.reqs.get(request.request_id)
        if st is None:
            st = self.reqs[request.request_id] = _Req(request)
        st.block_ids = list(block_ids)
        if num_external <= 0:
            return
        start, n = st.local // self.block_size, num_external // self.block_size
        load = Transfer(request.request_id, st.block_ids[start:start + n], list(request.block_hashes[start:start + n]))
        if st.load_async:  # handed over at the next step, scheduled or not: the request is parked
            self.async_loads.append(load)
        else:
            st.load = load
        self.counts["async_loads" if st.load_async else "sync_loads"] += 1
        st.loaded += n
        for t in st.tiers[:n]:
            self.hit_tokens[t] += self.block_size
        st.saved_upto = max(st.saved_upto, start + n)

    def build(self, so: Any) -> tuple[list[Transfer], list[Transfer], list[Transfer]]:
        """(sync loads, async loads, saves) of this step; loads are handed over once."""
        async_loads, self.async_loads = self.async_loads, []
        loads: list[Transfer] = []
        saves: list[Transfer] = []
        progress: list[tuple[_Req, int]] = []
        for nr in so.scheduled_new_reqs:
            st = self.reqs.get(nr.req_id)
            if st is None:
                continue
            st.block_ids = list(nr.block_ids[0])
            progress.append((st, nr.num_computed_tokens + so.num_scheduled_tokens.get(nr.req_id, 0)))
        cr = so.scheduled_cached_reqs
        for i, rid in enumerate(cr.req_ids):
            st = self.reqs.get(rid)
            if st is None:
                continue
            new = cr.new_block_ids[i]
            if rid in cr.resumed_req_ids and new is not None:
                st.block_ids = list(new[0])
            elif new is not None:
                st.block_ids.extend(new[0])
            progress.append((st, cr.num_computed_tokens[i] + so.num_scheduled_tokens.get(rid, 0)))
        for st, done in progress:
            if st.load is not None:
                loads.append(st.load)
                st.load = None
            hashes = st.request.block_hashes
            full = min(done // self.block_size, len(hashes), len(st.block_ids))
            if full > st.saved_upto:
                prompt_blocks = len(st.request.prompt_token_ids or ()) // self.block_size
                seg = ["system" if i < st.system else "user" if i < prompt_blocks else "assistant"
                       for i in range(st.saved_upto, full)]
                saves.append(Transfer(st.request.request_id, st.block_ids[st.saved_upto:full],
                                      list(hashes[st.saved_upto:full]), seg, st.cont, st.span))
                st.saved_upto = full
                st.saved_any, st.saved_epoch = True, _preemptions(st.request)
        return loads, async_loads, saves

    def load_failed(self, invalid: set[int]) -> None:
        """vLLM recomputes blocks a load could not serve: save them again once computed."""
        if not invalid:
            return
        for st in self.reqs.values():
            bad = [i for i, b in enumerate(st.block_ids) if b in invalid]
            if bad:
                st.saved_upto = min(st.saved_upto, bad[0])
                st.failed += len(bad)
                st.load_limit = bad[0] if st.load_limit is None else min(st.load_limit, bad[0])

    def finished(self, request: Any) -> tuple[bool, Optional[dict[str, Any]]]:
        """(hold the request's blocks until the worker reports its saves done, what kvtier
        did for it: returned to the caller with the request's output)."""
        st = self.reqs.pop(request.request_id, None)
        if st is None:
            return False, None
        info = {"loaded_tokens": st.loaded * self.block_size, "failed_tokens": st.failed * self.block_size,
                "load": ("async" if st.load_async else "sync") if st.loaded else None}
        # preempted since its last saves: vLLM freed its blocks and every worker dropped them
        # (``WorkerSide.preempted``), so nothing is left to wait for. One resumed, parked for an
        # async load and aborted would otherwise be freed twice, by its load and by its saves.
        return st.saved_any and _preemptions(request) == st.saved_epoch, {"kvtier": info}

    def hit_sources(self, request: Any, num_external: int) -> dict[str, int]:
        st = self.reqs.get(request.request_id)
        out: dict[str, int] = {}
        for t in (st.tiers if st else [])[: num_external // self.block_size]:
            out[TIER_SOURCES[t]] = out.get(TIER_SOURCES[t], 0) + self.block_size
        return out


def _preemptions(request: Any) -> int:
    """vLLM's count of the request's preemptions, bumped wherever it preempts (a schedule, a
    prefix-cache reset): the workers hear of each in the next step's ``preempted_req_ids``."""
    return int(getattr(request, "num_preemptions", 0) or 0)


__all__ = ["SchedulerSide", "Transfer", "TIER_SOURCES"]
