"""Async loads of the vLLM connector: blocks that are on NVMe come back between steps.

The scheduler marks a load async when some of its blocks are not in the daemon's
staging or DRAM tiers; vLLM then parks the request (``WAITING_FOR_REMOTE_KVS``)
and keeps running the others. Here the worker references and acquires those
blocks without waiting; every later step ``poll`` asks the daemon (one RPC per
pending load) whether they have all landed in staging slots, and only then checks
each layer's hash trailer and copies the request's blocks into vLLM's KV. Until
then the engine never waits: a load still reading NVMe is simply not finished.
A load that fails (a block gone, a corrupt NVMe copy, a trailer that does not
match, the daemon's deadline) is finished too, with its vLLM blocks reported as
load errors: vLLM recomputes them. The blocks written are the request's own
freshly allocated ones, which no forward reads until vLLM is told the load is
done, so copying between forwards is safe.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.client.replies import AcquireHandle, KvtierError
from kvtier.client.tier_client import TierClient

from .keys import block_keys, digests
from .kv_geometry import Geometry
from .vllm_scheduler import Transfer

log = logging.getLogger("kvtier.connectors.vllm")


@dataclass
class _Pending:
    req_id: str
    vids: list[int]          # vLLM block per loaded block
    refs: np.ndarray         # kvtier blocks we reference (one per distinct key)
    inverse: np.ndarray      # loaded block -> index into refs
    want: torch.Tensor       # [n, DIGEST_BYTES] expected trailers
    handle: AcquireHandle
    session: int             # the client session its refs and pins are in


class AsyncLoads:
    """The async loads in flight on one worker, and those finished but not yet reported."""

    def __init__(self, client: TierClient, geometry: Geometry, timeout_s: float, poll_interval_s: float = 0.001) -> None:
        self.client = client
        self.geo = geometry
        self.timeout_s = timeout_s
        # while only parked requests remain, vLLM steps in a tight loop: polling the daemon on every
        # step would take the CPU its movers need, so polls are at least this far apart
        self.poll_interval_s = poll_interval_s
        self._last_poll = 0.0
        self.pending: dict[str, _Pending] = {}
        self.finished: set[str] = set()     # loads done (or failed) since the last report
        self.errors: set[int] = set()       # vLLM blocks of failed loads, reported with them
        self.stats = {"async_loads": 0, "async_loaded_blocks": 0, "async_failed_blocks": 0}

    def start(self, loads: list[Transfer]) -> None:
        for t in loads:
            keys, inverse = np.unique(block_keys(t.hashes), return_inverse=True)
            self.stats["async_loads"] += 1
            session = self.client.session
            try:
                refs = self.client.ref(keys)
            except KvtierError as e:
                log.warning("kvtier: async load of %s failed to start (%s); vLLM recomputes it", t.req_id, e)
                self._fail(t.req_id, t.block_ids, np.zeros(0, dtype=np.int64))
                continue
            held = refs[refs >= 0]
            if held.size < refs.size:  # gone since the scheduler looked: nothing to wait for
                self._fail(t.req_id, t.block_ids, held)
                continue
            try:
                handle = self.client.acquire_async(blocks=refs, timeout_s=self.timeout_s)
            except KvtierError as e:
                log.warning("kvtier: async acquire of %s failed (%s); vLLM recomputes it", t.req_id, e)
                self._fail(t.req_id, t.block_ids, held)
                continue
            self.pending[t.req_id] = _Pending(t.req_id, list(t.block_ids), refs, inverse.reshape(-1),
                                              torch.from_numpy(digests(t.hashes)), handle, session)

    def poll(self) -> None:
        """Finish every load whose blocks have all landed (never waits for one that has not)."""
        if not self.pending:
            return
        gap = self._last_poll + self.poll_interval_s - time.monotonic()
        if gap > 0:
            time.sleep(gap)
        self._last_poll = time.monotonic()
        for rid in list(self.pending):
            p = self.pending[rid]
            if p.session != self.client.session:  # the daemon took that session's refs and pins back:
                del self.pending[rid]  # its ids may be the new session's now, so no RPC names them
                self._fail(rid, p.vids, np.zeros(0, dtype=np.int64))
                continue
            try:
                p.handle.poll()
                if not p.handle.done:
                    continue
                _, slots = p.handle.layers_ready()
            except KvtierError as e:  # the daemon dropped the acquire (and its pins)
                log.warning("kvtier: async load of %s failed (%s); vLLM recomputes it", rid, e)
                del self.pending[rid]
                self._fail(rid, p.vids, self._ours(p))
                continue
            del self.pending[rid]
            ok = self._copy(p, slots[p.inverse])
            if p.session == self.client.session:
                try:
                    self.client.release(blocks=np.unique(p.refs))
                except KvtierError as e:
                    log.warning("kvtier: releasing %s's loaded blocks failed: %s", rid, e)
            if ok:
                self._free(self._ours(p))
                self.finished.add(rid)
                self.stats["async_loaded_blocks"] += len(p.vids)
            else:
                self._fail(rid, p.vids, self._ours(p))

    def _copy(self, p: _Pending, slots: np.ndarray) -> bool:
        """Every layer's trailer checked before any byte reaches vLLM's KV."""
        hbm = self.client.hbm
        if hbm is None:  # reclaimed meanwhile: the slots are not ours to read
            return False
        rows = [hbm[int(s)] for s in slots.tolist()]
        layers = range(len(self.geo.layers))
        if not all(torch.equal(self.geo.trailer(li, r), p.want[i]) for li in layers for i, r in enumerate(rows)):
            log.warning("kvtier: a block's stored hash does not match (a 64-bit key collision); recomputed")
            return False
        for li in layers:
            for vid, r in zip(p.vids, rows):
                self.geo.load(li, vid, r)
        self.geo.settle()  # the copies are done before the release hands the slots back
        return True

    def _ours(self, p: _Pending) -> np.ndarray:
        """``p``'s refs while its session lasts; none after a reattach (the daemon took them)."""
        return p.refs if p.session == self.client.session else np.zeros(0, dtype=np.int64)

    def _fail(self, rid: str, vids: list[int], refs: np.ndarray) -> None:
        self._free(refs)
        self.errors.update(vids)
        self.finished.add(rid)  # vLLM must hear of a failed load too, in the same step as its errors
        self.stats["async_failed_blocks"] += len(vids)

    def _free(self, refs: np.ndarray) -> None:
        held = refs[refs >= 0]
        if held.size:
            try:
                self.client.free(blocks=held)
            except KvtierError as e:
                log.warning("kvtier: unreferencing loaded blocks failed: %s", e)

    def take(self) -> tuple[set[str], set[int]]:
        """(requests whose load finished, vLLM blocks that failed) since the last call."""
        done, self.finished = self.finished, set()
        errs, self.errors = self.errors, set()
        return done, errs


__all__ = ["AsyncLoads"]
