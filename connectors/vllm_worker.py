"""The worker half of the vLLM connector: bytes between vLLM's paged KV and kvtier.

vLLM's own KV tensors are the HBM tier; kvtier holds what falls out of them. A
kvtier block is one vLLM block of every layer: layer l's K/V bytes (exactly as
vLLM laid them out, whatever its backend's shape) followed by a ``DIGEST_BYTES``
trailer with the block's full vLLM hash, so layer parts are equal and the daemon
promotes them layer by layer. The daemon's HBM pool is the staging area both ways:

- save (``wait_for_save``, after the forward; on a stage that never gets it, at the next
  step's ``handle_preemptions``, see ``preempted``): new full blocks are copied into
  pinned staging slots, sealed under their keys, released and unreferenced; the
  daemon demotes them to DRAM/NVMe in the background. When the staging pool is
  full (demotions still writing), the blocks are queued, not waited for: each
  later step retries them, and vLLM keeps a finished request's blocks until its
  queued saves are done (``finished_sending``). A save still queued after
  ``save_timeout_s`` is dropped and counted (a future miss, never a stall).
- load (``start_load_kv`` before the forward), for blocks the scheduler found in
  staging or DRAM (NVMe loads are async: ``vllm_async``): one non-blocking
  acquire; ``wait_for_layer_load(l)`` waits only until layer l of those blocks
  has landed, checks its trailer against the hash vLLM asked for, and copies it
  into vLLM's blocks. A block the daemon cannot serve (gone, corrupt on NVMe, a
  trailer that does not match) is reported to vLLM, which recomputes it: a
  wrong byte is never handed to attention.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from kvtier.client.replies import AcquireHandle, KvtierError
from kvtier.client.tier_client import TierClient

from .keys import block_keys, digests
from .kv_geometry import Geometry
from .pp_taint import StageTaint
from .tp_taint import Agreement
from .vllm_scheduler import Transfer
from .vllm_staging import QueuedSave, stage, unref

log = logging.getLogger("kvtier.connectors.vllm")

# steps after a failed sync load whose saves are dropped: vLLM learns of the failure only from
# this step's output, and with async scheduling the next step is already scheduled by then;
# blocks computed meanwhile (the request's next chunk, another request sharing the bad blocks)
# attend to bytes that were never loaded, and a seal would keep them for every later request.
# The least window: with pipeline parallelism vLLM keeps as many batches in flight as stages
# (``max_concurrent_batches``), and the connector passes that when it is more
TAINTED_STEPS = 2


@dataclass
class _Load:
    transfers: list[Transfer]
    vids: torch.Tensor            # vLLM block per loaded block
    blocks: np.ndarray            # kvtier block per loaded block (refs we hold)
    want: torch.Tensor            # [n, DIGEST_BYTES] expected trailers
    handle: Optional[AcquireHandle]
    pos: np.ndarray               # index of each loaded block in the handle's reply
    done_layers: int = 0
    failed: bool = False
    session: int = 0              # the client session its refs and pins are in


class WorkerSide:
    def __init__(self, client: TierClient, geometry: Geometry, timeout_s: float = 30.0,
                 save_timeout_s: float = 10.0, idle: Optional[Callable[[], None]] = None,
                 agree: Optional[Agreement] = None, stages: Optional[StageTaint] = None,
                 window: int = TAINTED_STEPS) -> None:
        self.client = client
        self.geo = geometry
        self.timeout_s = timeout_s
        self.save_timeout_s = save_timeout_s
        self.idle = idle                    # run while a sync load waits (async loads finish meanwhile)
        self.agree = agree                  # tensor-parallel peers' taint windows (``Agreement``)
        self.agree_streak = 0               # steps in a row whose agreement failed (for the log)
        self.stages = stages                # earlier pipeline stages' taint windows (``StageTaint``)
        self.window = max(1, window)        # steps a failed load taints (``TAINTED_STEPS``)
        self.load: Optional[_Load] = None
        self.errors: set[int] = set()       # vLLM blocks that could not be loaded (reported once)
        self.queue: deque[QueuedSave] = deque()  # saves waiting for staging room, in order
        self.saving: set[str] = set()       # requests that handed us saves: vLLM holds their blocks until we say
        self.finishing: set[str] = set()    # ... and that vLLM has finished
        self.stats = {"loaded_blocks": 0, "saved_blocks": 0, "failed_blocks": 0, "load_wait_s": 0.0,
                      "save_queued_blocks": 0, "save_dropped_blocks": 0, "taint_agreement_failures": 0,
                      "upstream_tainted_steps": 0}
        self.step = 0
        self.sched_step = 0  # the scheduler's number of this step (the same on every stage), else ``step``
        self.tainted_until = -1  # the last step whose saves are dropped (``TAINTED_STEPS``)
        self.reported_step = -1  # the last step whose load errors vLLM has taken (``take_errors``)
        self.unsaved: Optional[list[Transfer]] = None  # this step's saves until ``save`` takes them
        max_batch = max(1, int(client.info.get("hbm_slots", 2)) // 2)
        self.save_batch = max_batch

    @property
    def layerwise(self) -> bool:
        """The daemon reports layer-wise progress in the parts of the first engine's geometry: ours only if equal."""
        return int(self.client.info.get("layers", 1)) == len(self.geo.layers)

    # -- load ---------------------------------------------------------------------
    def start(self, loads: list[Transfer], saves: Optional[list[Transfer]] = None,
              sched_step: Optional[int] = None) -> None:
        """This step's loads; ``saves``, the step's saves ``save`` will be given (kept in case
        vLLM never calls ``wait_for_save``: see ``preempted``); ``sched_step``, the scheduler's
        number of the step, which pipeline stages' taint windows are written in."""
        if self.load is not None or self.unsaved:  # the last step never finished, and no
            self.finish_load()                      # preempted() call saved it: its pins and refs go
            self._drop_unsaved()                    # (this step's forward may have reused its blocks)
        self.unsaved = list(saves) if saves else None
        self.step += 1
        self.sched_step = self.step if sched_step is None else int(sched_step)
        self.client.reattach()  # a daemon that restarted (or reclaimed us) is taken up again
        if not loads:
            self.load = None
            return
        vids = [b for t in loads for b in t.block_ids]
        hashes = [h for t in loads for h in t.hashes]
        keys, inverse = np.unique(block_keys(hashes), return_inverse=True)  # sessions may share blocks
        session = self.client.session
        try:
            refs = self.client.ref(keys)
        except KvtierError as e:  # no daemon: vLLM recomputes, it never stops for kvtier
            log.warning("kvtier: load of %d blocks failed to start (%s); vLLM recomputes them", keys.size, e)
            refs = np.full(keys.size, -1, dtype=np.int64)
        handle = None
        pos = np.zeros(0, dtype=np.int64)
        failed = bool(np.any(refs < 0))
        held = refs[refs >= 0]
        if not failed:
            try:
                handle = self.client.acquire_async(blocks=refs, timeout_s=self.timeout_s)
                pos = inverse.reshape(-1)  # replies follow the order of the blocks we name
            except KvtierError as e:
                log.warning("kvtier: acquire of %d blocks failed (%s); vLLM recomputes them", refs.size, e)
                failed = True
        self.load = _Load(loads, torch.tensor(vids, dtype=torch.int64), held, torch.from_numpy(digests(hashes)),
                          handle, pos, failed=failed, session=session)
        if failed:
            self._fail()

    def wait_layer(self, name: str) -> None:
        ld = self.load
        li = self.geo.index.get(name)
        if ld is None or ld.failed or li is None or li < ld.done_layers:
            return
        t0 = time.perf_counter()
        for layer in range(ld.done_layers, li + 1):
            if not self._copy_layer(ld, layer):
                break
        self.stats["load_wait_s"] += time.perf_counter() - t0

    def _copy_layer(self, ld: _Load, layer: int) -> bool:
        assert ld.handle is not None
        end = time.monotonic() + self.timeout_s
        try:
            while True:
                ready, slots = ld.handle.layers_ready()
                ready, slots = ready[ld.pos], slots[ld.pos]
                if ld.handle.done or (self.layerwise and np.all(ready > layer)):  # done: every layer landed
                    break
                if time.monotonic() > end:
                    raise KvtierError(f"layer {layer} not loaded within {self.timeout_s} s")
                if self.idle is not None:  # finished async loads free their staging pins for us
                    self.idle()
                time.sleep(0.001)  # each poll is an RPC: leave the daemon the CPU to move the bytes
        except KvtierError as e:
            log.warning("kvtier: load failed (%s); vLLM recomputes those blocks", e)
            ld.handle = None  # the daemon dropped the acquire and its pins
            self._fail()
            return False
        hbm = self.client.hbm
        if hbm is None:  # reclaimed meanwhile: the slots are not ours to read
            self._fail()
            return False
        rows = [hbm[int(sl)] for sl in slots.tolist()]
        if not all(torch.equal(self.geo.trailer(layer, r), ld.want[i]) for i, r in enumerate(rows)):
            log.warning("kvtier: a block's stored hash does not match (a 64-bit key collision); recomputed")
            self._fail()  # the full vLLM hash stored beside the bytes is not the one asked for
            return False
        for vid, r in zip(ld.vids.tolist(), rows):
            self.geo.load(layer, vid, r)
        ld.done_layers = layer + 1
        return True

    def _fail(self) -> None:
        ld = self.load
        if ld is None:
            return
        ld.failed = True
        self._taint_this_step()
        self.errors.update(ld.vids.tolist())
        self.stats["failed_blocks"] += int(ld.vids.numel())

    def finish_load(self) -> None:
        """After the forward: any layer not waited for is copied, then our pins and refs go."""
        ld = self.load
        if ld is None:
            return
        if not ld.failed:
            self.wait_layer(self.geo.layers[-1].name)
        if not ld.failed:
            self.stats["loaded_blocks"] += int(ld.vids.numel())
        if ld.session != self.client.session:  # reattached since: the daemon took its refs and pins
            self.load = None  # back, and its ids may be the new session's
            return
        try:  # our pins: wait for the acquire to settle, then let them go (a failed acquire took them)
            if ld.handle is not None:
                ld.handle.wait(self.timeout_s)
                self.geo.settle()  # the copies out of the staging slots are done before they go
                self.client.release(blocks=np.unique(ld.blocks))
        except KvtierError as e:
            log.warning("kvtier: releasing loaded blocks failed: %s", e)
        unref(self.client, ld.blocks)  # apart: a failed release must not keep the references for good
        self.load = None

    def _take_unsaved(self) -> list[Transfer]:
        """The saves ``save`` was never given. Their requests count as saving whether they are
        saved or dropped: vLLM holds a request's blocks until every worker reports it done."""
        skipped, self.unsaved = self.unsaved or [], None
        self.saving.update(t.req_id for t in skipped)
        return skipped

    def _drop_unsaved(self) -> None:
        self.stats["save_dropped_blocks"] += sum(len(t.block_ids) for t in self._take_unsaved())

    def take_errors(self) -> set[int]:
        self.reported_step = self.step
        out, self.errors = self.errors, set()
        return out

    # -- save ---------------------------------------------------------------------
    def agree_on_taint(self) -> None:
        """Once a step, on every rank after its loads: every rank drops the saves of the steps
        any rank's failure taints (the failing rank's window, late step and all). A collective
        that fails taints this step too (its peers may have failed)."""
        if self.agree is None:
            return
        try:
            ahead = self.agree(max(self.tainted_until - self.step, -1))
            self.tainted_until = max(self.tainted_until, self.step + ahead)
        except Exception as e:  # noqa: BLE001 - a broken group must not stop the engine's step
            self._taint_this_step()
            self.stats["taint_agreement_failures"] += 1
            self.agree_streak += 1
            if self.agree_streak & (self.agree_streak - 1) == 0:  # 1st, 2nd, 4th, 8th...: not every step
                log.warning("kvtier: tensor-parallel taint agreement failed (%s), %d step(s) in a row; those "
                            "steps' saves are dropped", e, self.agree_streak)
            return
        if self.agree_streak:
            log.warning("kvtier: tensor-parallel taint agreement works again after %d failed step(s)",
                        self.agree_streak)
            self.agree_streak = 0

    def _taint_this_step(self) -> None:
        """Drop saves from this step for ``window`` steps. A failure found after vLLM took
        this step's errors (with speculative decoding it saves, and so finishes loads, after
        that) is reported a step later, so one more step is tainted."""
        late = self.reported_step == self.step
        self.tainted_until = max(self.tainted_until, self.step + self.window - 1 + int(late))
        if self.stages is not None:  # later pipeline stages computed from this step's activations
            self.stages.publish(self.sched_step + self.tainted_until - self.step)

    def _upstream_taint(self) -> bool:
        """Drop this step's saves when an earlier pipeline stage's failed load taints it: this
        stage's KV was computed from that stage's activations. True if it does."""
        if self.stages is None or self.stages.upstream_until() < self.sched_step:
            return False
        self.tainted_until = max(self.tainted_until, self.step)  # this step only: each step reads again
        return True

    def save(self, saves: list[Transfer]) -> None:
        """Queue this step's new full blocks and save what the staging pool has room for."""
        self.unsaved = None
        self.agree_on_taint()  # first: with TP too, its all-reduce waits for every rank's forward
        if self._upstream_taint() and saves:
            self.stats["upstream_tainted_steps"] += 1
        now = time.monotonic()
        added = 0
        tainted = self.step <= self.tainted_until
        for t in saves:
            self.saving.add(t.req_id)
            if tainted:  # computed while a failed load's blocks may have been read
                self.stats["save_dropped_blocks"] += len(t.block_ids)
                continue
            for vid, h, seg in zip(t.block_ids, t.hashes, t.segment or ["user"] * len(t.block_ids)):
                self.queue.append(QueuedSave(t.req_id, vid, h, seg, now, t.cont, t.span))
                added += 1
        self.flush()
        self.stats["save_queued_blocks"] += min(added, len(self.queue))  # ours are the queue's tail

    def flush(self) -> None:
        """Save queued blocks in order while staging has room; never waits for room."""
        while self.queue:
            batch = [self.queue[i] for i in range(min(self.save_batch, len(self.queue)))]
            if self._save_batch(batch):
                for _ in batch:
                    self.queue.popleft()
                continue
            if time.monotonic() - self.queue[0].since <= self.save_timeout_s:
                break
            for _ in batch:  # staging stayed full too long: a future miss, not a held engine
                self.queue.popleft()
            self.stats["save_dropped_blocks"] += len(batch)
            log.warning("kvtier: no staging room for %d blocks in %.0f s; dropped", len(batch), self.save_timeout_s)

    def sent(self, finished_req_ids: set[str]) -> set[str]:
        """Finished requests whose saves are all done: vLLM may free their blocks now."""
        self.finishing |= finished_req_ids & self.saving
        self.flush()
        queued = {q.req_id for q in self.queue}
        done = {r for r in self.finishing if r not in queued}
        self.finishing -= done
        self.saving -= done
        return done

    def preempted(self, req_ids: set[str]) -> None:
        """At the start of every step (vLLM's ``handle_preemptions``). vLLM frees a preempted
        request's blocks at once: its queued saves would read reused blocks, and it is not
        reported sent unless it saves again.

        With speculative decoding vLLM 0.32 never calls ``wait_for_save`` on a pipeline stage
        before the last (it returns before its deferred finalize): the last step's load is
        finished and its saves are made here, before this step's forward can write a block
        of theirs, less the requests preempted now."""
        if req_ids and self.queue:
            keep = deque(q for q in self.queue if q.req_id not in req_ids)
            self.stats["save_dropped_blocks"] += len(self.queue) - len(keep)
            self.queue = keep
        if self.load is not None:  # the last step's, never finished
            self.finish_load()
        if self.unsaved is not None:
            skipped = self._take_unsaved()
            self.stats["save_dropped_blocks"] += sum(len(t.block_ids) for t in skipped if t.req_id in req_ids)
            self.save([t for t in skipped if t.req_id not in req_ids])
        self.saving -= req_ids  # the scheduler no longer waits for their saves (``SchedulerSide._preempted``)

    def _save_batch(self, batch: list[QueuedSave]) -> bool:
        """True when the batch is done with (saved, or failed for good); False: no room yet."""
        return stage(self.client, self.geo, batch, self.stats)


__all__ = ["Geometry", "WorkerSide"]
